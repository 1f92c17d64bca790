"""One tick of the quorum sensor: mirror the round records into Dagster (offers, decisions,
merges) and, while no syncer holds the lease, decide rounds here with the syncer's own state
machine (`pipelines/syncer/round_control.py`); the sensor's cursor carries the state between
ticks and is rebuilt from the store if lost."""

import json
import time

import dagster as dg

from diloco_core.liveness import observe, silent_for
from pipelines.defs.partitions import (
    FRAGMENT_TAG,
    MERGE_TAG,
    ROUND_TAG,
    rounds,
)
from pipelines.experiment_context import EXPERIMENT_TAG
from pipelines.offer_summary import OfferSummary
from pipelines.partition_keys import learner_partition_key, partition_key
from pipelines.round_mirror import fresh_mirror, mirror_tick
from pipelines.syncer.round_control import RoundController
from resources.store.lease_record import LeaseRecord
from resources.store.resource import ArtifactStoreResource

IN_PROGRESS = {dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
               dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
               dg.DagsterRunStatus.CANCELING}

def _partitions_request(exp: str, round_indices, per_partition: int) -> list:
    """One request adding the partitions that hold these rounds (adding a key that exists
    is a no-op, so a window of rounds is asked for again while its rounds open)."""
    keys = sorted({partition_key(exp, r, per_partition) for r in round_indices})
    return [rounds.build_add_request(keys)] if keys else []


def _offer_event(exp: str, offer: OfferSummary, per_partition: int
                 ) -> dg.AssetMaterialization:
    metadata: dict = {**offer.figures(), "encoding": offer.encoding, "late": offer.late}
    if offer.problem:
        metadata["problem"] = dg.MetadataValue.text(offer.problem)
    if offer.train_loss is not None:
        metadata["train/loss"] = offer.train_loss
    return dg.AssetMaterialization(
        asset_key="learner_update",
        partition=dg.MultiPartitionKey({
            "round": partition_key(exp, offer.round, per_partition),
            "learner": learner_partition_key(exp, offer.learner)}),
        description="late: offered after its round was decided" if offer.late else None,
        metadata=metadata)


def quorum_tick(context: dg.SensorEvaluationContext, store: ArtifactStoreResource
                ) -> dg.SensorResult | dg.SkipReason:
    """One quorum tick (the body of `quorum_sensor`; tests call it directly).

    With the syncer service (`orchestration.syncer: service`, the default) the sensor is the
    watcher: it mirrors the syncer's rounds, offers, merges and evals into Dagster, and only
    while the syncer's lease has not moved for `orchestration.syncer_timeout_seconds` (dead,
    hung, not started) does it decide rounds itself and request one merge run per round, as
    with `orchestration.syncer: sensor`. Both commit through the same store records, so a
    hand-over never decides or merges a round twice."""
    artifacts = store.active()
    if artifacts is None:
        return dg.SkipReason("no active experiment: launch the `train` job")
    from diloco_core.config_loading import config_from_mapping

    config = artifacts.get_config()
    if config is None:
        return dg.SkipReason(f"experiment {artifacts.experiment!r} is active but has no config "
                             "in the store yet")
    cfg = config_from_mapping(config)
    cursor = json.loads(context.cursor) if context.cursor else {}
    if "round" in cursor:   # a cursor from before the syncer service: the controller's state
        cursor = {"controller": cursor}
    if cursor.get("experiment") != artifacts.experiment:
        cursor = {"experiment": artifacts.experiment, "controller": cursor.get("controller")}
    now = time.time()
    cursor.setdefault("since", now)
    if cfg.orchestration.syncer == "sensor":
        return _decide_here(context, artifacts, cfg, cursor, "")
    lease = artifacts.get_syncer_lease()
    cursor["lease_seen"] = observe(cursor.get("lease_seen"),
                                   {"syncer": None if lease is None else lease.to_json()}, now)
    silent = silent_for(cursor["lease_seen"], "syncer", now)
    silent = now - cursor["since"] if silent is None else silent
    timeout = cfg.orchestration.syncer_timeout_seconds
    releasing = lease is not None and lease.status == "released"
    # No lease yet: a syncer run on its way to its first one (a run launch and imports, longer
    # than the timeout on a loaded machine) is given the supervisor's allowance, not judged
    # dead: no false "deciding here" at start-up.
    first = not lease and silent >= timeout and _syncer_starting(
        context.instance, artifacts.experiment, now, first_lease_allowance(timeout))
    if artifacts.finished() is not None or first or (silent < timeout and not releasing):
        if cursor.get("mode") == "fallback":
            context.log.info("the syncer service holds a live lease again: mirroring it")
        cursor["mode"] = "mirror"
        return _mirror(context.instance, artifacts, cfg, cursor, _lease_holder(lease, silent))
    why = ("the syncer released its lease" if releasing else
           f"no syncer has taken the lease in {silent:.0f}s (timeout {timeout:.0f}s)"
           if not lease else
           f"the syncer's lease has not moved for {silent:.0f}s (timeout {timeout:.0f}s)")
    if cursor.get("mode") != "fallback":
        context.log.warning(f"{why}: deciding and merging rounds here (merge runs) until a "
                            "syncer holds a live lease again")
    cursor["mode"] = "fallback"
    return _decide_here(context, artifacts, cfg, cursor, why)


def _summary_request(exp: str) -> dg.RunRequest:
    return dg.RunRequest(job_name="summarize", run_key=f"summary:{exp}",
                         tags={EXPERIMENT_TAG: exp, "dagster/max_retries": "3"})


def _decide_here(context: dg.SensorEvaluationContext, artifacts, cfg, cursor: dict,
                 why: str) -> dg.SensorResult:
    """The sensor decides rounds and requests merge runs (the fallback, or `syncer: sensor`)."""
    controller = RoundController(artifacts, cfg, forecast_state=cursor.get("forecast"))
    result = controller.tick(cursor.get("controller"))
    cursor["controller"] = result.state
    cursor["forecast"] = controller.forecast_state()
    exp = artifacts.experiment
    per_partition = cfg.rounds_per_partition
    requests = [dg.RunRequest(job_name="merge_round",
                              partition_key=partition_key(artifacts.experiment, d.round,
                                                            per_partition),
                              run_key=f"merge:{exp}:{d.round}",
                              tags={EXPERIMENT_TAG: exp, ROUND_TAG: str(d.round),
                                    FRAGMENT_TAG: str(d.fragment), MERGE_TAG: "1",
                                    "dagster/max_retries": "3"})
                for d in result.merges]
    if result.finished:
        requests.append(_summary_request(exp))
    for offer in result.offers:
        if offer.foreign:
            context.log.warning(f"ignored an offer to round {offer.round} from "
                                f"{offer.learner!r}: {offer.problem}")
    # What the mirror would report again when the syncer is back: these rounds are reported.
    mirror = cursor.setdefault("mirror", fresh_mirror())
    latest = result.state.get("round", -1)
    mirror["opened"] = max(mirror["opened"], latest)
    mirror["offers_from"] = max(mirror["offers_from"], latest + 1)
    mirror["offers"] = {}
    # Every round up to the newest opened gets its partition, not only those opened by this
    # tick: a tick that wrote a round-open record and then failed (a timeout in a slow store
    # retry, a daemon restart) returned no partition request, and that round's merge run
    # would fail on an unknown partition. The cursor moves only with the request.
    since = cursor.get("partitions_upto")
    if not isinstance(since, int):
        since = latest - 4 * cfg.sync.num_fragments - 1   # a lost cursor: the recent rounds
    added = sorted(set(range(max(since + 1, 0), latest + 1)) | set(result.opened))
    cursor["partitions_upto"] = max(latest, since)
    partitions = _partitions_request(artifacts.experiment, added, per_partition)
    reason = f"{why}; {result.reason}" if why else result.reason
    return dg.SensorResult(
        run_requests=requests, dynamic_partitions_requests=partitions,
        asset_events=[_offer_event(artifacts.experiment, o, per_partition) for o in result.offers
                      if not o.foreign],
        cursor=json.dumps(cursor),
        skip_reason=None if requests or partitions or result.offers else reason)


def _not_yet_evaluated(instance: dg.DagsterInstance, events: list) -> list:
    """`events` without the runless check evaluations the instance already holds. Dagster keeps
    one per (asset, check, partition) and raises on a second; a tick whose events were stored
    but whose cursor was not (the daemon killed in between) mirrors the same rounds again,
    and without this every later tick failed the same way: the sensor was dead for good."""
    from dagster._core.event_api import PartitionKeyFilter

    kept = []
    for event in events:
        if isinstance(event, dg.AssetCheckEvaluation):
            key = dg.AssetCheckKey(event.asset_key, event.check_name)
            history = instance.event_log_storage.get_asset_check_execution_history(
                key, limit=20, partition_filter=PartitionKeyFilter(key=event.partition))
            if any(record.run_id == "" for record in history):
                continue
        kept.append(event)
    return kept


def first_lease_allowance(timeout: float) -> float:
    """How long a started syncer run may go without taking the lease before it counts as
    stuck: imports and a run launch come first (tens of seconds on a loaded 2-core machine)."""
    return 3 * timeout + 60


def _syncer_starting(instance: dg.DagsterInstance, exp: str, now: float,
                     allowance: float) -> bool:
    """Whether the newest syncer run is in progress and younger than `allowance` seconds
    (from its start, or its creation while queued)."""
    records = instance.get_run_records(
        filters=dg.RunsFilter(job_name="syncer", tags={EXPERIMENT_TAG: exp}), limit=1)
    if not records or records[0].dagster_run.status not in IN_PROGRESS:
        return False
    started = records[0].start_time or records[0].create_timestamp.timestamp()
    return now - started < allowance


def _lease_holder(lease: LeaseRecord | None, moved_ago: float) -> str:
    """Who keeps the syncer's lease, for the tick's reason in the UI (the syncer's attempt or
    its warm standby). The age is since this sensor last saw the lease move, on its own clock:
    the holder's clock is never compared with it."""
    if lease is None:
        return "no syncer has taken the lease yet"
    who = f"{lease.holder_name} (attempt {lease.attempt}" + (
        ", the warm standby" if lease.standby else "") + ")"
    if lease.status == "released":
        return f"{who} released the syncer's lease"
    return f"{who} holds the syncer's lease, seen moving {moved_ago:.0f}s ago"


def _mirror(instance: dg.DagsterInstance, artifacts, cfg, cursor: dict,
            holder: str) -> dg.SensorResult:
    """The syncer service runs the rounds: record in Dagster what it did. `holder`: who
    holds the lease, said in the tick's reason when there is nothing to record."""
    from pipelines.partition_digest import hold_eval, hold_merge, hold_offer, release
    from pipelines.round_metadata import (
        eval_regression,
        global_params_checks,
        hold_checks,
        mirrored_eval,
        mirrored_global_params,
        release_checks,
    )

    result = mirror_tick(artifacts, cfg, cursor.get("mirror"))
    cursor["mirror"] = result.state
    exp = artifacts.experiment
    per_partition = cfg.rounds_per_partition
    single = per_partition == 1
    # Several rounds per partition: their checks are held and evaluated once per partition,
    # and their figures recorded as one digest per asset and partition (partition_digest.py).
    held = cursor.setdefault("held_checks", {})
    digests = cursor.setdefault("held_digests", {})
    closed = int(cursor.get("checks_closed_upto", -1))
    events: list = []
    for offer in (o for o in result.offers if not o.foreign):
        if single:
            events.append(_offer_event(exp, offer, per_partition))
        else:
            hold_offer(digests, partition_key(exp, offer.round, per_partition), offer)
    for round_index, record, decision, version in result.merges:
        key = partition_key(exp, round_index, per_partition)
        if single:
            events += mirrored_global_params(artifacts, key, record, decision, version)
            continue
        hold_merge(digests, key, round_index, record, decision, version)
        if round_index > closed:
            hold_checks(held, key, "global_params", global_params_checks(
                record, version, record.finite), round_index)
    for round_index, evaluation, previous in result.evals:
        key = partition_key(exp, round_index, per_partition)
        if single:
            events += mirrored_eval(key, round_index, evaluation, previous)
            continue
        hold_eval(digests, key, round_index, evaluation)
        if round_index > closed:
            hold_checks(held, key, "heldout_eval", [eval_regression(evaluation, previous)],
                        round_index)
    # The run is finished and the mirror has caught up with its rounds (this tick mirrored no
    # more fates; at most MAX_ROUNDS_PER_TICK a tick): then, not before, every held partition
    # is released and the summary requested (its run ends the experiment's activity, and with
    # it the mirroring). Released while its rounds were still being mirrored, a partition
    # would be recorded twice, each digest with part of its rounds.
    settled = result.finished and not result.fates_moved
    if not single:
        mirrored = None if settled else min(result.state["fates"] - 1, result.state["evals"])
        closed_to_offers = None if settled else result.state["offers_from"] - 1
        events += release(digests, mirrored, exp, closed_to_offers)
        released, cursor["checks_closed_upto"] = release_checks(held, mirrored, closed)
        events += released
    events = _not_yet_evaluated(instance, events)
    requests = [_summary_request(exp)] if settled else []
    partitions = _partitions_request(exp, result.opened, per_partition)
    return dg.SensorResult(
        run_requests=requests, dynamic_partitions_requests=partitions, asset_events=events,
        cursor=json.dumps(cursor),
        skip_reason=None if requests or partitions or events else
        f"{holder}; round {cursor['mirror']['opened']} is the newest")
