"""What every result file says about the machine that produced it."""

from pipelines.reporting import cpu_model


def test_the_cpu_model_is_read_from_cpuinfo_and_never_left_blank(tmp_path):
    # Two machines of one platform string and core count ran one soak 3-13% apart: a result
    # names the processor. A blank "model name" or no /proc/cpuinfo falls back, never to "".
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                       "model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
                       "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n")
    assert cpu_model(cpuinfo) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: \n")
    assert cpu_model(cpuinfo) != ""
    assert cpu_model(tmp_path / "absent") != ""
