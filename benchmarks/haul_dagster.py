"""The long haul's syncer as the product runs it: on a Dagster instance (`long_haul.py --dagster`).

The instance runs as a production deployment does (`DagsterDev(split=True)`: a code server, the
webserver and the daemon, each its own process group, SQLite storage in its home). The haul
launches the `train` job through the webserver; the learner supervisor launches the syncer
service as a Dagster run (Pipes, the product's environment) and the quorum sensor mirrors every
round into the instance, with the partition grouping the config chooses. The learners are the
haul's synthetic ones, outside Dagster: each is registered as an in-progress `learner` run
before `train` starts, as a learner process the supervisor launched would be, so that the
supervisor watches their heartbeats instead of launching real learners.

Each sample adds what the instance costs: resident memory by process kind (daemon, code
server, webserver, run workers, the syncer's standby; the syncer is measured by the haul), its
databases' bytes (the haul adds the whole home's), the runs it holds, and the quorum sensor's ticks
since the last sample (count, duration median and max).
"""

import json
import statistics
import time
import uuid
from pathlib import Path

from orchestration_demo import ROLES as DEMO_ROLES
from orchestration_demo import memory_snapshot, process_tree

from pipelines.commands.dagster_dev import DagsterDev
from pipelines.defs.partitions import LEARNER_TAG
from pipelines.experiment_context import EXPERIMENT_TAG

# The syncer's warm standby: a child process of the syncer, its own module with this flag.
STANDBY_MARKER = "--standby-for"
# The demo's roles, with the standby told apart from the syncer.
ROLES = (("syncer standby", STANDBY_MARKER), *DEMO_ROLES)
SENSOR = "quorum_sensor"


def _database_parts(home: Path) -> dict[str, int]:
    """The SQLite instance's bytes by what they hold: the sensor and schedule ticks
    (`schedules.db`, purged by the instance's tick retention), the runs (`runs.db`), the asset
    events reported outside runs (the quorum sensor's mirror, `runs/.db`), the index of every
    event (`runs/index.db`) and the runs' own event logs (one file a run)."""
    parts = {"ticks": 0, "runs": 0, "mirror_events": 0, "event_index": 0, "run_events": 0}
    for path in home.rglob("*.db"):
        name = path.name
        part = ("ticks" if name == "schedules.db" else "runs" if name == "runs.db"
                else "mirror_events" if name == ".db" else "event_index"
                if name == "index.db" else "run_events")
        parts[part] += path.stat().st_size
    return parts


def _rounded(value):
    """A probe figure to 2 places: a number, a list of them (one an arena), or None."""
    if isinstance(value, list):
        return [round(v, 2) for v in value]
    return value if value is None else round(value, 2)


class DagsterSide:
    """`with DagsterSide(tmp, overrides, names, experiment) as side:` the instance runs, `train`
    has committed the experiment to `side.store_root`, and the supervisor is launching the
    syncer service."""

    def __init__(self, tmp: Path, overrides: list[str], learner_names: list[str],
                 experiment: str, tick_seconds: int = 2,
                 extra_env: dict[str, str] | None = None, heap_probe: Path | None = None):
        self.home, self.store_root = tmp / "dagster_home", tmp / "store"
        self.overrides, self.names, self.experiment = overrides, learner_names, experiment
        self.env = {"DILOCO_STORE_URI": str(self.store_root), "DILOCO_ENV": "local",
                    "DILOCO_TICK_SECONDS": str(tick_seconds),
                    "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2", **(extra_env or {})}
        self.heap_probe = heap_probe    # the code server's allocator samples (--heap-probe)
        self.dev: DagsterDev | None = None
        self.last_tick = 0.0
        self.syncer_pids: set[int] = set()       # more than one: the syncer was relaunched

    def __enter__(self) -> "DagsterSide":
        import dagster as dg

        # Room for the registered learners, `train`, the syncer, a summary and a merge or two.
        self.dev = DagsterDev(self.home, env=self.env, split=True,
                              max_concurrent_runs=len(self.names) + 6)
        self.dev.__enter__()
        try:
            with dg.DagsterInstance.from_config(str(self.home)) as instance:
                for name in self.names:
                    instance.add_run(dg.DagsterRun(
                        job_name="learner", run_id=str(uuid.uuid4()),
                        status=dg.DagsterRunStatus.STARTED,
                        run_config={"ops": {"run_learner": {"config": {"learner": name,
                                                                       "attempt": 0}}}},
                        tags={EXPERIMENT_TAG: self.experiment, LEARNER_TAG: name}))
            self.train_run = self.dev.submit_job("train", {"ops": {"start_experiment": {
                "config": {"overrides": [*self.overrides, f"name={self.experiment}"],
                           "orchestrated_defaults": False}}}})
        except BaseException:
            self.dev.__exit__(None, None, None)
            raise
        self.last_tick = time.time()
        return self

    def __exit__(self, *exc) -> None:
        if self.dev is not None:
            self.dev.__exit__(*exc)

    def train_succeeded(self) -> bool | None:
        """True once `train` succeeded, False if it failed, None while it runs."""
        import dagster as dg

        with dg.DagsterInstance.from_config(str(self.home)) as instance:
            run = instance.get_run_by_id(self.train_run)
        if run is None or not run.is_finished:
            return None
        return run.status == dg.DagsterRunStatus.SUCCESS

    def alive(self) -> bool:
        return self.dev is not None and all(s.alive() for s in self.dev.services.values())

    def syncer_pid(self) -> int | None:
        """The syncer service's process, once its Dagster run has launched it (a descendant of
        the code server: the run worker's Pipes subprocess)."""
        server = None if self.dev is None else self.dev.services["code_server"].process
        if server is None:
            return None
        pid = next((pid for pid, cmd in process_tree(server.pid)
                    if "pipelines.syncer.entry" in cmd and STANDBY_MARKER not in cmd), None)
        if pid is not None:
            self.syncer_pids.add(pid)
        return pid

    def relaunches(self) -> int:
        """How many times a new syncer process was seen after the first."""
        return max(0, len(self.syncer_pids) - 1)

    def log_tail(self) -> list[str]:
        """The daemon's last lines (the syncer's own log is its run's, in the instance)."""
        assert self.dev is not None
        path = self.dev.log_path.with_name(f"{self.dev.log_path.stem}-daemon.log")
        return path.read_text(errors="replace").splitlines()[-5:] if path.exists() else []

    def _heap(self) -> dict:
        """The code server's newest allocator sample from inside (`--heap-probe`), or none."""
        if self.heap_probe is None or not self.heap_probe.exists():
            return {}
        lines = self.heap_probe.read_text().splitlines()
        if not lines:
            return {}
        row = json.loads(lines[-1])
        # `grpc_`: the code server's gRPC process alone (its `code_server_rss_mb` adds the proxy).
        return {f"grpc_{k}": _rounded(v) for k, v in row.items() if k != "t"}

    def sample(self) -> dict:
        """The instance's cost now, and the quorum sensor's ticks since the last sample."""
        import dagster as dg
        from dagster._core.scheduler.instigation import TickStatus

        rss: dict[str, float] = {}
        assert self.dev is not None
        for service in self.dev.services.values():
            if service.process is None:
                continue
            for role, row in memory_snapshot(service.process.pid, ROLES)["by_role"].items():
                if role not in ("syncer", "other"):    # the haul measures the syncer itself
                    rss[role] = rss.get(role, 0.0) + row["rss_mib"]
        now = time.time()
        with dg.DagsterInstance.from_config(str(self.home)) as instance:
            runs = instance.get_runs_count()
            state = next((s for s in instance.all_instigator_state()
                          if s.instigator_name == SENSOR), None)
            ticks = [] if state is None else instance.get_ticks(
                state.instigator_origin_id, state.selector_id, after=self.last_tick)
        done = [t for t in ticks if t.end_timestamp is not None]
        seconds = [t.end_timestamp - t.timestamp for t in done]
        self.last_tick = now
        by_part = _database_parts(self.home)
        heap = self._heap()
        return {
            **heap,
            **{f"{kind.replace(' ', '_')}_rss_mb": round(mb, 1) for kind, mb in rss.items()},
            "dagster_database_bytes": sum(by_part.values()),
            **{f"dagster_db_{part}_bytes": size for part, size in by_part.items()},
            "dagster_runs": runs,
            "sensor_ticks": len(ticks),
            "sensor_tick_failures": sum(1 for t in ticks if t.status == TickStatus.FAILURE),
            "sensor_tick_p50_s": statistics.median(seconds) if seconds else None,
            "sensor_tick_max_s": max(seconds) if seconds else None,
        }
