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


# One process of a learner run under Pipes, as the run starts every pod of a multi-host
# learner: same Pipes parameters, its own DILOCO process id.
SESSION = """
import json, sys
from pipelines.learner_entry import pipes_session
with pipes_session(int(sys.argv[1])) as (params, log, report):
    log.info("hello from the learner")
    log.warning("a warning from the learner")
    report({"status": "done"})
print(json.dumps(params))
"""


def test_only_process_0_of_a_multi_host_learner_opens_the_pipes_session(tmp_path):
    """Every process that opened a session would write its own opened/closed messages and
    number its message chunks from 0 under the run's one prefix, overwriting the leader's log
    and final record; the others still get the run's extras."""
    import json
    import os

    from dagster_pipes import encode_env_var

    extras = {"store": "gs://b/p", "experiment": "e", "learner": "learner-1", "attempt": 2}
    context = {"asset_keys": None, "code_version_by_asset_key": None,
               "provenance_by_asset_key": None, "partition_key": None,
               "partition_key_range": None, "partition_time_window": None, "run_id": "r",
               "job_name": "learner", "retry_number": 0, "extras": extras}
    (tmp_path / "context.json").write_text(json.dumps(context))
    written = {}
    for process_id in (1, 0):
        messages = tmp_path / f"messages-{process_id}.jsonl"
        env = {**os.environ,
               "DAGSTER_PIPES_CONTEXT": encode_env_var({"path": str(tmp_path / "context.json")}),
               "DAGSTER_PIPES_MESSAGES": encode_env_var({"path": str(messages)})}
        env.pop("DILOCO_PIPES_CHANNEL", None)
        out = subprocess.run([sys.executable, "-c", SESSION, str(process_id)], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == extras
        lines = messages.read_text().splitlines() if messages.exists() else []
        written[process_id] = [json.loads(line)["method"] for line in lines]
        if process_id == 1:     # its own stdout (the pod's log), each line with its level
            assert "INFO [process 1] hello from the learner" in out.stdout
            assert "WARNING [process 1] a warning from the learner" in out.stdout
        else:                   # the run's log, through Pipes, at each line's level
            logged = [json.loads(line)["params"] for line in lines
                      if json.loads(line)["method"] == "log"]
            assert [(m["level"], m["message"]) for m in logged] == [
                ("INFO", "hello from the learner"), ("WARNING", "a warning from the learner")]
    assert written[1] == []
    assert written[0][0] == "opened" and written[0][-1] == "closed"
    assert {"log", "report_custom_message"} <= set(written[0])
