"""The test session ends what its tests left running (tests/session_cleanup.py)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TESTS = Path(__file__).parent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_process_a_test_left_running_is_ended_with_the_session(tmp_path):
    # A test that starts a process in its own session and never stops it: the way a SIGKILLed
    # Dagster run worker leaves its compute log's `tail -F` behind, reparented away from pytest.
    pid_file = tmp_path / "pid"
    (tmp_path / "test_leak.py").write_text(textwrap.dedent(f"""
        import subprocess

        def test_leaks():
            proc = subprocess.Popen(["sleep", "600"], start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            open({str(pid_file)!r}, "w").write(str(proc.pid))
    """))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "session_cleanup",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_leak.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(TESTS), os.environ.get("PYTHONPATH", "")])})
    pid = int(pid_file.read_text())
    try:
        assert run.returncode == 0, run.stdout + run.stderr
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the leaked process outlived its test session"
        assert f"ended 1 process(es) the tests left running:\n  {pid}: sleep 600" in run.stdout
    finally:
        if _alive(pid):
            os.kill(pid, 9)
