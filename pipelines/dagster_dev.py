"""A local Dagster instance for the demo and the end-to-end tests: `dagster dev` (webserver,
daemon with the sensors and run queue, code server) on a private DAGSTER_HOME.

`dagster dev` ignores SIGTERM for a while, so it runs in its own process group and is stopped
by signalling the whole group (SIGINT, then SIGKILL after a grace period).
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent


def instance_yaml(max_concurrent_runs: int) -> dict:
    """Run queue: one process per learner, one merge at a time per fragment (so versions of a
    fragment commit in round order) and two in all, run retries for crashed merges, run
    monitoring."""
    return {
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": "QueuedRunCoordinator",
            "config": {
                "max_concurrent_runs": max_concurrent_runs,
                "dequeue_interval_seconds": 1,
                "tag_concurrency_limits": [
                    {"key": "diloco/learner", "value": {"applyLimitPerUniqueValue": True},
                     "limit": 1},
                    {"key": "diloco/fragment", "value": {"applyLimitPerUniqueValue": True},
                     "limit": 1},
                    # At most two merge runs at once (memory and CPU on a small machine).
                    {"key": "diloco/merge", "limit": 2},
                ],
            },
        },
        "run_retries": {"enabled": True, "max_retries": 0},
        "run_monitoring": {"enabled": True, "poll_interval_seconds": 10},
        "telemetry": {"enabled": False},
        "nux": {"enabled": False},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DagsterDev:
    """`with DagsterDev(home, env) as dev:` serves the code location until the block ends."""

    def __init__(self, home: Path, env: dict[str, str] | None = None, port: int | None = None,
                 max_concurrent_runs: int = 10, log_path: Path | None = None):
        self.home = Path(home).resolve()
        self.port = port or free_port()
        self.env = {**os.environ, "DAGSTER_HOME": str(self.home), **(env or {})}
        self.max_concurrent_runs = max_concurrent_runs
        self.log_path = log_path or self.home / "dagster-dev.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "DagsterDev":
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "dagster.yaml").write_text(
            yaml.safe_dump(instance_yaml(self.max_concurrent_runs), sort_keys=False))
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in __exit__
        self._log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dagster", "dev", "-w", str(REPO_ROOT / "workspace.yaml"),
             "-h", "127.0.0.1", "-p", str(self.port)],
            cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {self.process.returncode}; see "
                                   f"{self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/server_info", timeout=5):
                    pass
                if self._location_loaded():
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"dagster dev did not serve within {timeout:.0f}s; see "
                           f"{self.log_path}")

    def _location_loaded(self) -> bool:
        data = self.graphql("{ workspaceOrError { ... on Workspace { locationEntries { "
                            "loadStatus } } } }")
        entries = data["workspaceOrError"].get("locationEntries", [])
        return bool(entries) and all(e["loadStatus"] == "LOADED" for e in entries)

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(f"{self.url}/graphql", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            payload = json.loads(response.read())
        if payload.get("errors"):
            raise RuntimeError(f"GraphQL errors: {payload['errors']}")
        return payload["data"]

    def submit_job(self, job_name: str, run_config: dict, tags: dict | None = None) -> str:
        from dagster_graphql import DagsterGraphQLClient

        client = DagsterGraphQLClient("127.0.0.1", port_number=self.port)
        return client.submit_job_execution(job_name, run_config=run_config, tags=tags or {})

    def stop(self, grace: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGINT)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait(10)
        # Runs launched by the daemon (learners, merges) live in the same group; make sure
        # nothing of this instance outlives it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self._log.close()
