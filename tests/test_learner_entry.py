"""The learner process entry point honours termination (SIGINT, as Dagster Pipes forwards it)
even when it inherited SIGINT ignored, as every process under a shell's background job does."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Waits "forever" like a hung learner, after what learner_entry.main does first (or not).
HUNG = """
import sys, time
if sys.argv[1] == "entry":
    from pipelines.learner_entry import honour_termination
    honour_termination()
print("ready", flush=True)
time.sleep(120)
"""


def _start_hung(with_entry: bool) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HUNG, "entry" if with_entry else "bare"], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # What `cmd &` in a non-interactive shell (nohup, CI runners) hands its children.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


@pytest.mark.parametrize("with_entry", [True, False])
def test_sigint_ends_a_learner_that_inherited_sigint_ignored(with_entry):
    proc = _start_hung(with_entry)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        try:
            # Unwinding takes well under a second; the bare process would never end.
            proc.wait(20 if with_entry else 3)
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
        # The bare process shows the hazard the entry point removes: SIGINT does nothing.
        assert ended is with_entry
        if with_entry:
            assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
