"""The code server's sensor ticks hold no memory past the tick, over the weeks of a run: alembic
registered an ExitStack with atexit for each Dagster instance a tick opens
(pipelines/alembic_paths.py), glibc kept the heap the ticks freed (each tick now hands it
back: pipelines/defs/sensors.py), and glibc's thread arenas kept the large blocks the gRPC
threads freed (each tick fixes the mmap threshold). Evaluated here as the code server
evaluates them (Dagster's gRPC implementation, `get_external_sensor_execution`, with an
instance reference)."""

import atexit
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster._grpc.impl import get_external_sensor_execution


@pytest.fixture
def code_location(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_STORE_URI", str(tmp_path / "store"))
    monkeypatch.setenv("DILOCO_ENV", "local")
    import pipelines.defs.sensors as sensors
    from pipelines.definitions import defs  # loading the code location: the alembic mend

    # Not in the test process: a fixed mmap threshold would stay for every later test in it
    # (that the tick sets it is checked in a process of its own, below).
    monkeypatch.setattr(sensors, "unmap_large_blocks", lambda: True)
    return defs().get_repository_def()


def _evaluate(repo, ref, sensor: str) -> None:
    result = get_external_sensor_execution(repo, None, ref, sensor, None, None, None, None, None)
    assert not hasattr(result, "error"), result     # a skip ("no active experiment"), not an error


@pytest.mark.parametrize("sensor", ["quorum_sensor", "learner_supervisor"])
def test_sensor_ticks_register_nothing_at_exit(code_location, monkeypatch, sensor):
    registered = []
    real_register = atexit.register

    def counting_register(fn, *args, **kwargs):
        registered.append(fn)
        return real_register(fn, *args, **kwargs)

    with dg.instance_for_test() as instance:
        ref = instance.get_ref()
        _evaluate(code_location, ref, sensor)      # the first resolves alembic's paths once
        monkeypatch.setattr(atexit, "register", counting_register)
        for _ in range(10):
            _evaluate(code_location, ref, sensor)
    # Before the mend: 2 a tick (the run and the schedule storage's schema checks), kept until
    # the process exits; ~5 KB a tick, the code server's +3.5 MB per 1,000 rounds.
    assert registered == []


@pytest.mark.parametrize("sensor", ["quorum_sensor", "learner_supervisor"])
def test_each_sensor_tick_hands_the_freed_heap_back(code_location, monkeypatch, sensor):
    """What the release does is tests/test_process_memory.py's; here, that every tick asks."""
    import pipelines.defs.sensors as sensors

    released = []
    monkeypatch.setattr(sensors, "release_free_heap", lambda: released.append(1))
    with dg.instance_for_test() as instance:
        for _ in range(3):
            _evaluate(code_location, instance.get_ref(), sensor)
    assert len(released) == 3


def test_a_sensor_tick_keeps_large_blocks_from_settling_in_thread_arenas():
    """After one tick, a 4 MB block freed in each of four threads goes back to the system: the
    tick fixed glibc's mmap threshold (resources/process_memory.py). In a fresh process, since
    the threshold is process-wide; `tests/large_block_probe.py default` is the same probe
    without a tick (16 MB kept, tests/test_process_memory.py)."""
    probe = Path(__file__).with_name("large_block_probe.py")
    out = subprocess.run([sys.executable, str(probe), "sensor"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert float(out[-1]) < 2
