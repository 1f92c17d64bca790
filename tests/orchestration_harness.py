"""Drive the orchestration in-process: a Dagster test instance, a local store, scripted learners.

Scripted learners write what real learner processes write (heartbeats, contributions built
with the core `LearnerSync` from the current global fragment) without training, so the sensor
and merge logic can be driven tick by tick, deterministically.
"""

import json
import time

import dagster as dg
import numpy as np

from diloco_core.compression import encode
from diloco_core.config_loading import config_from_mapping
from diloco_core.contribution import Contribution
from pipelines.definitions import defs as load_defs
from pipelines.defs.quorum_tick import quorum_tick
from pipelines.partition_keys import learner_partition_key, partition_key
from resources.store.resource import ArtifactStoreResource


def wait_until(predicate, what: str, timeout: float = 60.0, interval: float = 0.05) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


TINY = ["model.preset=tiny", "data.seq_len=32", "data.batch_size=4", "learners.num_learners=3",
        "sync.num_fragments=2", "sync.sync_period=4", "sync.min_quorum=2",
        "sync.grace_gamma=0", "token_budget=100000", "orchestration.eval_batches=1",
        "name=exp-test",
        # The quorum sensor decides and requests merge runs itself (the syncer service's
        # fallback path); tests of the service add "orchestration.syncer=service".
        "orchestration.syncer=sensor"]


# For scripted learners that jump past the token budget in one heartbeat, to test what comes
# after STOP: the syncer credits a heartbeat's total only as far as the learner's offers and
# peers corroborate it (`syncer_machine.credited`), so a jump would be held. Those rules have
# their own tests (test_syncer_machine, test_untrusted_learner); these turn them off.
JUMPS = ["sync.max_speed_ratio=inf"]


class Harness:
    def __init__(self, instance: dg.DagsterInstance, store_uri: str, overrides=(),
                 resources: dict | None = None, **store_kw):
        self.instance = instance
        self.resource = ArtifactStoreResource(base_uri=store_uri, **store_kw)
        loaded = load_defs()
        self.defs = dg.Definitions(
            assets=loaded.assets, asset_checks=loaded.asset_checks, jobs=loaded.jobs,
            schedules=loaded.schedules, sensors=loaded.sensors,
            resources={**(loaded.resources or {}), **(resources or {}), "store": self.resource})
        self.overrides = list(TINY) + list(overrides)
        self.cursor: str | None = None
        self.now = time.time()
        self.tokens: dict[str, int] = {}
        self.launched: list[dg.RunRequest] = []

    # ---- the experiment -----------------------------------------------------------------------
    def start(self, fault_tape_path: str | None = None) -> None:
        # A run with a fault tape is launched as a chaos run: nothing else honours a tape.
        chaos = ["orchestration.chaos=true"] if fault_tape_path else []
        result = self.defs.resolve_job_def("train").execute_in_process(
            instance=self.instance,
            run_config={"ops": {"start_experiment": {"config": {
                "overrides": self.overrides + chaos, "orchestrated_defaults": False,
                "fault_tape_path": fault_tape_path}}}})
        assert result.success
        self.store = self.resource.active()
        self.cfg = config_from_mapping(self.store.get_config())

    # ---- scripted learners --------------------------------------------------------------------
    def open_round_index(self) -> int:
        """The newest open round (-1 before the first)."""
        latest = self.store.latest_open_round()
        return -1 if latest is None else latest.round

    def train_rounds(self, rounds: int, beating: list[str], offering: tuple[str, ...],
                     timeout: float) -> None:
        """Scripted learners against a live syncer: `beating` heartbeat and `offering` offer
        each open round, until `rounds` more rounds have opened."""
        target = self.open_round_index() + rounds
        deadline = time.monotonic() + timeout
        while self.open_round_index() < target:
            assert time.monotonic() < deadline, f"no round {target} within {timeout:.0f} s"
            self.now = time.time()
            for name in beating:
                self.beat(name, 2)
            latest = self.store.latest_open_round()
            if latest is not None:
                for name in offering:
                    if self.store.contribution_manifest(latest.round, name) is None:
                        self.offer(name, latest.round)
            time.sleep(0.3)

    def beat(self, learner: str, steps: int = 0, status: str = "training") -> None:
        tokens = self.tokens.get(learner, 0) + steps * self.cfg.tokens_per_learner_step
        self.tokens[learner] = tokens
        self.store.put_heartbeat(learner, {
            "learner": learner, "status": status, "time": self.now, "attempt": 0,
            "step": tokens // self.cfg.tokens_per_learner_step, "tokens_total": tokens,
            "compute_seconds": 0.01 * max(1, tokens), "training_seconds": 1.0})

    def contribution(self, learner: str, round_index: int, *, fragment: int | None = None,
                     scale: float = 0.01, base_version: int | None = None, steps: int = 4,
                     seed: int = 0, shape_of=None, value=None) -> Contribution:
        """Delta = anchor - theta for a learner that moved every value by ~`scale`."""
        frag = (round_index % self.cfg.sync.num_fragments) if fragment is None else fragment
        current = self.store.load_global(frag % self.cfg.sync.num_fragments)
        rng = np.random.default_rng([seed, round_index, sum(map(ord, learner))])
        delta = {}
        for name, values in current.params.items():
            shape = shape_of(name, values.shape) if shape_of else values.shape
            d = rng.standard_normal(shape).astype(np.float32) * scale
            if value is not None:
                d[...] = value
            delta[name] = encode(d, self.cfg.sync.encoding, self.cfg.sync.encoding_block_size)
        version = current.version if base_version is None else base_version
        tokens = steps * self.cfg.tokens_per_learner_step
        return Contribution(learner, frag, round_index, version, tokens, steps, 0,
                            self.now, delta)

    def offer(self, learner: str, round_index: int, **kw) -> None:
        self.store.put_contribution(self.contribution(learner, round_index, **kw),
                                    {"train_loss": 3.0})

    # ---- the daemon's part --------------------------------------------------------------------
    def tick(self, advance: float = 1.0, real_time: bool = False
             ) -> dg.SensorResult | dg.SkipReason:
        """One quorum tick, then what the daemon does with it: add partitions, record asset
        events, launch runs not launched before under the same run key (and run them, retried
        like the daemon's run retries when they fail). `real_time`: the clock is the wall
        clock (real learner processes), not the harness's scripted one."""
        self.now = time.time() if real_time else self.now + advance
        context = dg.build_sensor_context(instance=self.instance, cursor=self.cursor,
                                          resources={"store": self.resource})
        original = time.time
        try:
            time.time = lambda: self.now
            result = quorum_tick(context, self.resource)
        finally:
            time.time = original
        if isinstance(result, dg.SkipReason):
            return result
        self.cursor = result.cursor
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(request.partitions_def_name,
                                                 list(request.partition_keys))
        for event in result.asset_events or []:
            self.instance.report_runless_asset_event(event)
        for request in result.run_requests or []:
            if request.run_key and self.instance.get_runs(
                    filters=dg.RunsFilter(tags={"dagster/run_key": request.run_key})):
                continue
            self.launched.append(request)
            retries = int(request.tags.get("dagster/max_retries", 0))
            for _ in range(retries + 1):
                run = self.defs.resolve_job_def(request.job_name).execute_in_process(
                    instance=self.instance, partition_key=request.partition_key,
                    tags={**request.tags, "dagster/run_key": request.run_key},
                    raise_on_error=False)
                if run.success:
                    break
        return result

    def decider(self, path: str):
        """One decider tick as a function: the quorum sensor's ("sensor"), or a syncer
        service's ("service", attempt 0, holding the lease, which renews on this harness's
        scripted clock so whether it moved between two ticks never depends on machine speed).
        Returns (step, service or None)."""
        if path != "service":
            return (lambda: self.tick()), None
        from pipelines.syncer.service import SyncerService

        service = SyncerService(self.store, attempt=0)
        service.lease.clock = lambda: self.now
        service.lease.acquire(4)

        def step():
            self.now += 1.0
            service.step(now=self.now)
        return step, service

    def state(self) -> dict:
        """The round controller's state in the sensor's cursor."""
        return json.loads(self.cursor)["controller"]

    def key(self, round_index: int) -> str:
        """The round's Dagster partition key (the experiment's, one round per partition)."""
        return partition_key(self.store.experiment, round_index)

    def learner_key(self, learner: str) -> str:
        return learner_partition_key(self.store.experiment, learner)

    def merged_rounds(self) -> set[str]:
        return set(self.instance.get_materialized_partitions(dg.AssetKey("global_params")))

    def merge_metadata(self, round_index: int) -> dict:
        records = self.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("global_params"),
                                  asset_partitions=[self.key(round_index)]), limit=1).records
        return records[0].asset_materialization.metadata
