"""The newcomer's path through a run, on the real daemon: `diloco demo`, Ctrl-C in the middle
(one line with the command that resumes it, no traceback, the instance gone in seconds), that
command run to the end, then `diloco list` and `diloco status` with no --store and no
--experiment finding the finished run. Slow: two demo processes of the tiny model."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_end_to_end import E2E

from pipelines.commands.cli import main
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store

ROOT = Path(__file__).resolve().parent.parent


def _merges(runs: Path) -> int:
    for store_dir in runs.glob("*/store"):
        for exp in (store_dir / "experiments").glob("*"):
            store = ArtifactStore(open_blob_store(str(store_dir)), exp.name)
            if store.get_config() is not None:
                return sum(store.current_version(p) or 0 for p in range(2))
    return 0


def _cli(argv: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipelines.commands.cli", *argv], cwd=cwd,
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ctrl_c_then_the_printed_command_resumes_and_list_finds_the_run(tmp_path, monkeypatch,
                                                                         capsys):
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_STORE_URI"}
    env.update(DILOCO_TICK_SECONDS="2", PYTHONPATH=str(ROOT))
    sets = [arg for o in E2E if not o.startswith("name=") for arg in ("--set", o)]
    demo = _cli(["demo", *sets], tmp_path, env)
    try:
        deadline = time.monotonic() + 600
        while _merges(tmp_path / "runs") < 2:
            assert demo.poll() is None, demo.communicate()
            assert time.monotonic() < deadline, "no merges within 10 minutes"
            time.sleep(1)
        interrupted = time.monotonic()
        demo.send_signal(signal.SIGINT)          # what Ctrl-C sends the foreground process
        out, err = demo.communicate(timeout=60)
        stopped_in = time.monotonic() - interrupted
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 130, (out, err)
    assert stopped_in < 20, stopped_in
    assert "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "interrupted" in x]
    prefix = "demo: interrupted; resume this run with: "
    assert line.startswith(prefix), err
    resume = shlex.split(line[len(prefix):])
    assert resume[:2] == ["diloco", "demo"] and "--workdir" in resume
    merged_before = _merges(tmp_path / "runs")

    again = _cli(resume[1:], tmp_path, env)
    try:
        out, err = again.communicate(timeout=900)
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
    assert again.returncode == 0, (out[-3000:], err[-3000:])
    assert "rounds merged" in out and "Traceback" not in err

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DILOCO_STORE_URI", raising=False)
    assert main(["list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["experiment"].startswith("diloco-demo-") and row["state"] == "finished"
    assert main(["status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "finished" and status["rounds_merged"] >= merged_before
