"""The project's processes log with levels: `DILOCO_LOG_LEVEL` filters them, each line says
its level, and a bad level stops the process naming the variable before it does anything."""

import logging
import os
import subprocess
import sys
from pathlib import Path

from resources.process_log import LEVEL_ENV, at_level, log_level

REPO = Path(__file__).resolve().parents[1]

# What a learner or syncer started by hand does with its logger (pipelines/learner_entry.py).
SCRIPT = """
from resources.process_log import stdout_logger
log = stdout_logger("learner")
log.debug("a debug line")
log.info("an info line")
log.warning("a warning line")
log.error("an error line")
"""


def _run(level: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != LEVEL_ENV}
    if level is not None:
        env[LEVEL_ENV] = level
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_process_logs_at_info_by_default_with_each_lines_level():
    out = _run(None)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "INFO an info line", "WARNING a warning line", "ERROR an error line"]


def test_the_level_variable_filters_every_line_below_it():
    out = _run("warning")
    assert out.returncode == 0, out.stderr
    assert "an info line" not in out.stdout
    assert "WARNING a warning line" in out.stdout and "ERROR an error line" in out.stdout
    assert "DEBUG a debug line" in _run("DEBUG").stdout


def test_a_bad_level_stops_the_process_naming_the_variable():
    out = _run("loud")
    assert out.returncode != 0
    assert f"{LEVEL_ENV}='LOUD': not a log level" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_pipes_logger_is_filtered_at_the_same_level(monkeypatch):
    monkeypatch.setenv(LEVEL_ENV, "ERROR")
    logger = logging.getLogger("test.pipes-like")
    assert at_level(logger) is logger and logger.level == logging.ERROR
    monkeypatch.delenv(LEVEL_ENV)
    assert log_level() == logging.INFO


def test_a_lease_taken_from_a_live_holder_is_a_warning_and_a_handover_is_not(tmp_path, caplog):
    """The level is chosen where the line is written: taking the lease from a syncer that
    did not give it back (it died or stalled) is worth a warning; a hand-over is routine."""
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store
    from resources.store.lease import SyncerLease

    store = ArtifactStore(open_blob_store(str(tmp_path)), "exp")
    clock = iter(range(0, 10_000, 5))
    first = SyncerLease(store, 0, clock=lambda: float(next(clock)), sleep=lambda s: None)
    first.acquire(1)
    caplog.set_level(logging.INFO, logger="resources.store.lease")
    second = SyncerLease(store, 1)
    second.acquire(1)                      # attempt 0 never released it
    second.release()
    third = SyncerLease(store, 2)
    third.acquire(1)
    levels = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records]
    assert levels == [("WARNING", "syncer attempt 1"), ("INFO", "syncer attempt 2")]
