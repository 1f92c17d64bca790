"""A sweep's worker processes end with the sweep: killing the process that runs `run_arms`
must not leave its workers training (and writing runs) on their own."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The sweep, as a process of its own: `run_arms` over two arms with two workers, each arm's
# run replaced by one that records its worker's pid and then takes five minutes (a real run's
# order of time). The replacement is a module-level function of this script, so the spawned
# workers import it by name as they would `run_arm`.
SWEEP = textwrap.dedent("""
    import os
    import sys
    import time
    from pathlib import Path

    def slow_run(arm, runs_dir, sizes=None):
        (Path(runs_dir) / f"worker-{os.getpid()}.pid").write_text(str(os.getpid()))
        time.sleep(300)

    if __name__ == "__main__":
        sys.path.insert(0, sys.argv[2])
        from benchmarks.quality import parallel
        from benchmarks.quality.experiments import DATA_PARALLEL, Arm

        parallel.run_arm = slow_run
        arms = [Arm("orphan test", DATA_PARALLEL, seed=s, tokens=100_000) for s in (0, 1)]
        parallel.run_arms(arms, Path(sys.argv[1]), workers=2)
""")


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits on whoever adopted it to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_killing_a_sweep_ends_its_workers(tmp_path):
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP)
    runs = tmp_path / "runs"
    runs.mkdir()
    sweep = subprocess.Popen([sys.executable, str(script), str(runs), str(REPO)], cwd=tmp_path)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180      # two spawned interpreters importing JAX
        while len(workers) < 2 and time.monotonic() < deadline and sweep.poll() is None:
            time.sleep(0.5)
            workers = [int(p.read_text()) for p in runs.glob("worker-*.pid")]
        assert len(workers) == 2, f"the workers did not start (sweep exit {sweep.poll()})"

        sweep.send_signal(signal.SIGKILL)      # no clean-up of its own: the parent just ends
        sweep.wait(timeout=30)
        deadline = time.monotonic() + 30       # the watch polls each second
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if _alive(pid)], \
            "the workers outlived the sweep that started them"
    finally:
        if sweep.poll() is None:
            sweep.kill()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
