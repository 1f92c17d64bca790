"""A local Dagster instance for the demo and the end-to-end tests: `dagster dev` (webserver,
daemon with the sensors and run queue, code server) on a private DAGSTER_HOME.

Its storage (runs, event logs, schedules and sensor state) is SQLite files in DAGSTER_HOME by
default, or a PostgreSQL database (dagster-postgres) given by a `postgresql://` URL, as a
production deployment uses.

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
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
# Where Dagster's processes run: the checkout (relative paths as in the README), or, for an
# installed package (no checkout around it), the directory the command was started from.
SERVICE_DIR = REPO_ROOT if (REPO_ROOT / "pyproject.toml").exists() else Path.cwd()


def check_postgres_url(url: str) -> str:
    """Return `url` if it is a PostgreSQL connection URL (`postgresql://` or
    `postgresql+<driver>://`), else raise ValueError saying what is wrong (without echoing a
    password)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme != "postgresql" and not scheme.startswith("postgresql+"):
        shown = f"{parts.scheme}://..." if parts.scheme else repr(url[:20])
        hint = (" (SQLAlchemy, which Dagster uses, no longer accepts the postgres:// alias)"
                if scheme == "postgres" else "")
        raise ValueError(f"not a PostgreSQL URL: {shown}; expected "
                         f"postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE{hint}")
    try:
        _ = parts.port  # raises on a port that is not a number
    except ValueError as err:
        raise ValueError(f"bad port in the PostgreSQL URL {redact_url(url)}: {err}") from None
    from resources.extras import require_extra

    require_extra("postgres", "a Dagster instance on PostgreSQL", ("dagster_postgres",
                                                                   "psycopg2"))
    return url


def redact_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


# The daemon's purge of sensor and schedule ticks. The two sensors tick every few seconds for
# the whole run (~20,000 ticks a day each); Dagster keeps successful sensor ticks forever by
# default. Kept: a week of ticks that did something, a month of failures, a day of skips.
TICK_RETENTION = {
    "sensor": {"purge_after_days": {"skipped": 1, "success": 7, "failure": 30, "started": 7}},
    "schedule": {"purge_after_days": {"skipped": 7, "success": 30, "failure": 30,
                                      "started": 30}},
}


def instance_yaml(max_concurrent_runs: int, postgres_url: str | None = None) -> dict:
    """Run queue: one process per learner, one merge at a time per fragment (so versions of a
    fragment commit in round order) and two in all, run retries for crashed merges, run
    monitoring. Storage: SQLite in DAGSTER_HOME, or the PostgreSQL database at `postgres_url`
    (runs, event logs and schedule/sensor state all in that one database)."""
    storage = ({"storage": {"postgres": {
        "postgres_url": check_postgres_url(postgres_url)}}}
        if postgres_url is not None else {})
    return {
        **storage,
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": "QueuedRunCoordinator",
            "config": {
                "max_concurrent_runs": max_concurrent_runs,
                "dequeue_interval_seconds": 1,
                # Launch what one dequeue admits side by side (a launch is mostly waiting on
                # the code server and a process start): the M learners and the syncer that
                # the supervisor requests at the start otherwise launch one after another.
                "dequeue_use_threads": True,
                "dequeue_num_workers": 4,
                "tag_concurrency_limits": [
                    {"key": "diloco/learner", "value": {"applyLimitPerUniqueValue": True},
                     "limit": 1},
                    {"key": "diloco/syncer", "limit": 1},   # one syncer service process
                    {"key": "diloco/fragment", "value": {"applyLimitPerUniqueValue": True},
                     "limit": 1},
                    # At most two merge runs at once (memory and CPU on a small machine).
                    {"key": "diloco/merge", "limit": 2},
                ],
            },
        },
        "run_retries": {"enabled": True, "max_retries": 0},
        "run_monitoring": {"enabled": True, "poll_interval_seconds": 10},
        "retention": TICK_RETENTION,
        "telemetry": {"enabled": False},
        "nux": {"enabled": False},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One long-running process in its own process group, so that it can be crashed (SIGKILL
    to the group) or stopped (SIGINT, then SIGKILL) without touching its siblings."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path):
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, cwd=SERVICE_DIR, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 30.0, crash: bool = False) -> None:
        """End the group: SIGKILL at once when `crash`, else SIGINT and SIGKILL after `grace`.
        Runs launched by the group (learners, merges under the code server) end with it."""
        if self.process is None:
            return
        pgid = self.process.pid  # the group leader: start_new_session made pid == pgid
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL if crash else signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5 if crash else grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


def reap_orphaned_runs(home: Path) -> list[str]:
    """Mark the runs an instance crash left behind (STARTING, STARTED, CANCELING with no
    process any more) as failed, so that tag concurrency slots free up and run retries and
    the learner supervisor take over. Only valid while no part of the instance is running:
    every run worker of a local instance lives under its code server, which is gone."""
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    stale = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
    with DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs(filters=RunsFilter(statuses=stale))
        for run in runs:
            instance.report_run_failed(
                run, message="The instance restarted while this run was in progress; its "
                             "process is gone (marked failed so that it can be retried).")
        return [run.run_id for run in runs]


def _init_storage(home: Path) -> None:
    """Create the instance's schemas once, before three processes race to (what `dagster dev`
    does in its own process before it starts the others): SQLite files in `home`, or the
    tables in the PostgreSQL database, which this also proves reachable."""
    from dagster import DagsterInstance

    with DagsterInstance.from_config(str(home)) as instance:
        instance.get_runs(limit=1)
        instance.all_instigator_state()


@dataclass(frozen=True)
class Restart:
    """One restart of (part of) the instance: which services, when, how long it took, and
    how many runs it left in progress that were marked failed."""
    services: tuple[str, ...]
    at: float
    reaped_runs: int
    seconds: float

    def to_json(self) -> dict:
        return {**asdict(self), "services": list(self.services)}


class DagsterDev:
    """`with DagsterDev(home, env) as dev:` serves the code location until the block ends.

    By default this is `dagster dev` (one process group). With `split=True` it runs the same
    instance as a production deployment does, as three process groups: a code server (which
    launches and therefore owns the runs), the webserver and the daemon, each restartable on
    its own: `restart_webserver()`, `restart_daemon()`, and `restart_instance()` (a crash of
    all three, runs included, then a cold start from the same DAGSTER_HOME and store).

    With `postgres_url` the instance keeps its runs, event logs and sensor state in that
    PostgreSQL database instead of SQLite files in `home`. The database must belong to this
    instance alone: `restart_instance()` marks every run it finds in progress there as failed.
    """

    def __init__(self, home: Path, env: dict[str, str] | None = None, port: int | None = None,
                 max_concurrent_runs: int = 10, log_path: Path | None = None,
                 split: bool = False, postgres_url: str | None = None):
        self.postgres_url = (check_postgres_url(postgres_url) if postgres_url is not None
                             else None)
        self.home = Path(home).resolve()
        self.port = port or free_port()
        self.env = {**os.environ, "DAGSTER_HOME": str(self.home), **(env or {})}
        self.max_concurrent_runs = max_concurrent_runs
        self.log_path = log_path or self.home / "dagster-dev.log"
        self.split = split
        self.services: dict[str, Service] = {}
        self.restarts: list[Restart] = []

    def _build_services(self) -> None:
        py = sys.executable
        if not self.split:
            # The code location by module, written here rather than the checkout's
            # workspace.yaml: an installed package has no checkout.
            workspace = self.home / "workspace.yaml"
            workspace.write_text(yaml.safe_dump({"load_from": [{"python_module": {
                "module_name": "pipelines.definitions", "location_name": "diloco"}}]}))
            self.services = {"dev": Service("dev", [
                py, "-m", "dagster", "dev", "-w", str(workspace),
                "-h", "127.0.0.1", "-p", str(self.port)], self.env, self.log_path)}
            return
        grpc_port = self.grpc_port = free_port()
        workspace = self.home / "workspace-grpc.yaml"
        workspace.write_text(yaml.safe_dump({"load_from": [{"grpc_server": {
            "host": "127.0.0.1", "port": grpc_port, "location_name": "diloco"}}]}))
        logs = {n: self.log_path.with_name(f"{self.log_path.stem}-{n}.log")
                for n in ("code-server", "webserver", "daemon")}
        self.services = {
            "code_server": Service("code_server", [
                py, "-m", "dagster", "code-server", "start", "-h", "127.0.0.1",
                "-p", str(grpc_port), "-m", "pipelines.definitions", "--location-name",
                "diloco", "--use-python-environment-entry-point"], self.env,
                logs["code-server"]),
            "webserver": Service("webserver", [
                py, "-m", "dagster_webserver", "-w", str(workspace), "-h", "127.0.0.1",
                "-p", str(self.port)], self.env, logs["webserver"]),
            "daemon": Service("daemon", [py, "-m", "dagster._daemon", "run", "-w",
                                         str(workspace)], self.env, logs["daemon"]),
        }

    def __enter__(self) -> "DagsterDev":
        self.home.mkdir(parents=True, exist_ok=True)
        config = self.home / "dagster.yaml"
        config.write_text(yaml.safe_dump(
            instance_yaml(self.max_concurrent_runs, self.postgres_url), sort_keys=False))
        if self.postgres_url:
            config.chmod(0o600)  # it holds the database URL, password included
            try:  # fail here, with the reason, rather than in three processes' logs
                _init_storage(self.home)
            except Exception as err:
                raise RuntimeError(f"cannot use the PostgreSQL database "
                                   f"{redact_url(self.postgres_url)} as the instance "
                                   f"storage: {err}") from err
        elif self.split:
            _init_storage(self.home)
        self._build_services()
        try:
            self._start(list(self.services))
        except BaseException as err:
            self.stop(self.INTERRUPT_GRACE if isinstance(err, KeyboardInterrupt) else 30.0)
            raise
        return self

    # On Ctrl-C the user is waiting at the terminal: the instance gets a short grace, then is
    # killed (learners resume from their checkpoints; nothing the store holds is lost).
    INTERRUPT_GRACE = 5.0

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(self.INTERRUPT_GRACE if exc_type is KeyboardInterrupt else 30.0)

    def stop(self, grace: float = 30.0) -> None:
        # Webserver and daemon first, so that nothing launches runs while the code server
        # (and with it every run) goes down.
        for service in reversed(list(self.services.values())):
            service.stop(grace)

    def restart_webserver(self) -> None:
        self._restart(["webserver"])

    def restart_daemon(self) -> None:
        self._restart(["daemon"])

    def restart_instance(self) -> None:
        """Crash every process of the instance (runs included) with SIGKILL, mark the runs it
        left in progress as failed, and start it again on the same home and store."""
        self._restart(list(self.services), reap=True)

    def _restart(self, names: list[str], reap: bool = False) -> None:
        if not self.split:
            raise RuntimeError("restarting parts of the instance needs DagsterDev(split=True)")
        began = time.time()
        for name in names:
            self.services[name].stop(crash=True)
        reaped = reap_orphaned_runs(self.home) if reap else []
        self._start(names)
        self.restarts.append(Restart(services=tuple(names), at=began, reaped_runs=len(reaped),
                                     seconds=time.time() - began))

    def _start(self, names: list[str]) -> None:
        # The code server first: the webserver and the daemon load the code location once at
        # their start, and keep an error if it is not serving yet.
        if "code_server" in names:
            self.services["code_server"].start()
            self._wait_code_server()
        for name in names:
            if name != "code_server":
                self.services[name].start()
        self.wait_ready()

    def _wait_code_server(self, timeout: float = 180.0) -> None:
        from dagster._grpc.client import DagsterGrpcClient

        client = DagsterGrpcClient(port=self.grpc_port, host="127.0.0.1")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            service = self.services["code_server"]
            if not service.alive():
                raise RuntimeError(f"the code server exited with {service.process.returncode}; "
                                   f"see {service.log_path}")
            with contextlib.suppress(Exception):  # gRPC raises its own errors until it serves
                # Probe the port first: the gRPC client prints every refused connection.
                socket.create_connection(("127.0.0.1", self.grpc_port), timeout=1).close()
                if client.health_check_query() == "SERVING":
                    return
            time.sleep(0.5)
        raise TimeoutError(f"the code server did not serve within {timeout:.0f}s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for service in self.services.values():
                if not service.alive():
                    raise RuntimeError(f"{service.name} exited with "
                                       f"{service.process.returncode}; see {service.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/server_info", timeout=5):
                    pass
                if self._location_loaded():
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"Dagster did not serve within {timeout:.0f}s; see "
                           f"{self.log_path}")

    def _location_loaded(self) -> bool:
        data = self.graphql("{ workspaceOrError { ... on Workspace { locationEntries { "
                            "loadStatus locationOrLoadError { __typename } } } } }")
        entries = data["workspaceOrError"].get("locationEntries", [])
        return bool(entries) and all(
            e["loadStatus"] == "LOADED"
            and e["locationOrLoadError"]["__typename"] == "RepositoryLocation" for e in entries)

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(f"{self.url}/graphql", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            payload = json.loads(response.read())
        if payload.get("errors"):
            raise RuntimeError(f"GraphQL errors: {payload['errors']}")
        return payload["data"]

    # Run statuses that a shutdown would interrupt (the runs end as failures).
    IN_FLIGHT = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING")

    def runs_in_flight(self) -> list[str]:
        """'job (run id)' of each run of the instance not yet ended."""
        data = self.graphql(
            "query InFlight($statuses: [RunStatus!]) { runsOrError(filter: "
            "{statuses: $statuses}) { __typename ... on Runs { results { runId jobName } } } }",
            {"statuses": list(self.IN_FLIGHT)})["runsOrError"]
        if data["__typename"] != "Runs":
            raise RuntimeError(f"runs query failed: {data['__typename']}")
        return [f"{r['jobName']} ({r['runId'][:8]})" for r in data["results"]]

    def submit_job(self, job_name: str, run_config: dict, tags: dict | None = None) -> str:
        from dagster_graphql import DagsterGraphQLClient

        client = DagsterGraphQLClient("127.0.0.1", port_number=self.port)
        return client.submit_job_execution(job_name, run_config=run_config, tags=tags or {})
