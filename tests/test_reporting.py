"""What every result file says about the machine that produced it."""

import subprocess

from pipelines.reporting import code_revision, cpu_model


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


def test_a_result_is_dirty_only_when_the_code_that_ran_differs_from_its_commit(tmp_path):
    # A benchmark re-makes its own committed result (and plot) before it records the revision:
    # that, or an edited page, must not mark the result as made by uncommitted code. An edited
    # module must, and every changed path is still listed.
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)
    for path in ("diloco_core/merge.py", "benchmarks/results/x.json", "docs/img/x.png",
                 "README.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("a\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "base")
    assert code_revision(tmp_path)["dirty"] is False
    for path in ("benchmarks/results/x.json", "docs/img/x.png", "README.md"):
        (tmp_path / path).write_text("b\n")
    revision = code_revision(tmp_path)
    assert revision["dirty"] is False
    assert sorted(revision["dirty_files"]) == ["README.md", "benchmarks/results/x.json",
                                               "docs/img/x.png"]
    (tmp_path / "diloco_core/merge.py").write_text("b\n")
    assert code_revision(tmp_path)["dirty"] is True
