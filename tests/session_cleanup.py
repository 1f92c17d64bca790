"""A pytest plugin that ends the processes a test session left running.

Every process the session starts inherits a mark in its environment (Dagster's run workers and
their `tail -F` of the compute logs, learners, servers); once the session's fixtures are torn
down, whatever still carries the mark was left behind, and is ended and listed. The mark is
fresh for each session, so a session started from inside a test does not end its caller's.
"""

import contextlib
import os
import signal
import uuid
from pathlib import Path

SESSION_MARK = "DILOCO_TEST_SESSION"


def pytest_configure(config):
    os.environ[SESSION_MARK] = uuid.uuid4().hex


def _marked_processes(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment carries this session's mark."""
    needle = f"{SESSION_MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
        except OSError:     # gone, or not ours to read
            continue
        found.append((int(entry.name), cmdline))
    return found


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def pytest_sessionfinish(session, exitstatus):
    """End what the session left running. A test that kills a Dagster run worker's process
    group with SIGKILL also kills the watcher Dagster pairs with each `tail -F` of a compute
    log, and the tail then outlives the run: CI left two such processes behind every run.
    By this point every fixture has been torn down, so anything still marked is a leak."""
    if not Path("/proc").is_dir() or SESSION_MARK not in os.environ:
        return
    mine = _ancestors()
    leaked = [(pid, cmd) for pid, cmd in _marked_processes(os.environ[SESSION_MARK])
              if pid not in mine]
    for pid, _ in leaked:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"  {pid}: {cmd[:160]}" for pid, cmd in leaked]
        message = "\n".join([f"ended {len(leaked)} process(es) the tests left running:", *lines])
        if reporter is not None:
            reporter.write_line(message)
