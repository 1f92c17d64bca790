"""The syncer's sensors: quorum (rounds, decisions, merges) and learner supervision.

Both are on by default. Their tick interval is `DILOCO_TICK_SECONDS` (default 5), read when the
code location loads. Each tick costs a fixed number of small store reads per learner plus the
new contributions since the last tick; the cursor carries the state between ticks and is
rebuilt from the store if lost.
"""

import json
import os
import time

import dagster as dg

from diloco_core.liveness import LIVE_STATUSES, observe, silent_for
from pipelines.defs.learners import learner
from pipelines.defs.partitions import (
    FRAGMENT_TAG,
    LEARNER_TAG,
    MERGE_TAG,
    REGION_TAG,
    ROUND_TAG,
    SYNCER_TAG,
    learners,
    rounds,
)
from pipelines.defs.rounds import merge_job
from pipelines.defs.summary import summary_job
from pipelines.defs.syncer import syncer
from pipelines.experiment_context import EXPERIMENT_TAG
from pipelines.partition_keys import learner_partition_key, partition_key
from pipelines.round_control import RoundController
from pipelines.round_mirror import fresh_mirror, mirror_tick
from resources.store.resource import ArtifactStoreResource

IN_PROGRESS = {dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
               dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
               dg.DagsterRunStatus.CANCELING}


def _partitions_request(exp: str, round_indices, per_partition: int) -> list:
    """One request adding the partitions that hold these rounds (adding a key that exists
    is a no-op, so a window of rounds is asked for again while its rounds open)."""
    keys = sorted({partition_key(exp, r, per_partition) for r in round_indices})
    return [rounds.build_add_request(keys)] if keys else []


def _offer_event(exp: str, offer: dict, per_partition: int) -> dg.AssetMaterialization:
    metadata = {k: offer[k] for k in ("fragment", "base_version", "tokens", "steps", "nbytes",
                                      "learner_step", "staleness") if offer.get(k) is not None}
    metadata["encoding"] = offer.get("encoding") or ""
    metadata["late"] = bool(offer["late"])
    if offer.get("problem"):
        metadata["problem"] = dg.MetadataValue.text(str(offer["problem"]))
    if offer.get("train_loss") is not None:
        metadata["train/loss"] = float(offer["train_loss"])
    return dg.AssetMaterialization(
        asset_key="learner_update",
        partition=dg.MultiPartitionKey({
            "round": partition_key(exp, offer["round"], per_partition),
            "learner": learner_partition_key(exp, offer["learner"])}),
        description="late: offered after its round was decided" if offer["late"] else None,
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
    cursor["lease_seen"] = observe(cursor.get("lease_seen"), {"syncer": lease}, now)
    silent = silent_for(cursor["lease_seen"], "syncer", now)
    silent = now - cursor["since"] if silent is None else silent
    timeout = cfg.orchestration.syncer_timeout_seconds
    releasing = (lease or {}).get("status") == "released"
    # No lease yet: a syncer run on its way to its first one (a run launch and imports, longer
    # than the timeout on a loaded machine) is given the supervisor's allowance, not judged
    # dead: no false "deciding here" at start-up.
    first = not lease and silent >= timeout and _syncer_starting(
        context.instance, artifacts.experiment, now, _first_lease_allowance(timeout))
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
    result = RoundController(artifacts, cfg).tick(cursor.get("controller"))
    cursor["controller"] = result.state
    exp = artifacts.experiment
    per_partition = cfg.rounds_per_partition
    requests = [dg.RunRequest(job_name="merge_round",
                              partition_key=partition_key(artifacts.experiment, d["round"],
                                                            per_partition),
                              run_key=f"merge:{exp}:{d['round']}",
                              tags={EXPERIMENT_TAG: exp, ROUND_TAG: str(d["round"]),
                                    FRAGMENT_TAG: str(d["fragment"]), MERGE_TAG: "1",
                                    "dagster/max_retries": "3"})
                for d in result.merges]
    if result.finished:
        requests.append(_summary_request(exp))
    for offer in result.offers:
        if offer.get("foreign"):
            context.log.warning(f"ignored an offer to round {offer['round']} from "
                                f"{offer['learner']!r}: {offer['problem']}")
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
                      if not o.get("foreign")],
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


def _first_lease_allowance(timeout: float) -> float:
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


def _lease_holder(lease: dict | None, moved_ago: float) -> str:
    """Who keeps the syncer's lease, for the tick's reason in the UI (the syncer's attempt or
    its warm standby). The age is since this sensor last saw the lease move, on its own clock:
    the holder's clock is never compared with it."""
    from resources.store.lease import LeaseView

    view = LeaseView.of(lease)
    if view is None:
        return "no syncer has taken the lease yet"
    who = f"{view.name} (attempt {view.attempt}" + (
        ", the warm standby" if view.standby else "") + ")"
    if view.status == "released":
        return f"{who} released the syncer's lease"
    return f"{who} holds the syncer's lease, seen moving {moved_ago:.0f}s ago"


def _mirror(instance: dg.DagsterInstance, artifacts, cfg, cursor: dict,
            holder: str) -> dg.SensorResult:
    """The syncer service runs the rounds: record in Dagster what it did. `holder`: who
    holds the lease, said in the tick's reason when there is nothing to record."""
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
    per_partition = cfg.rounds_per_partition
    single = per_partition == 1
    # Several rounds per partition: their checks are held and evaluated once per partition.
    held = cursor.setdefault("held_checks", {})
    closed = int(cursor.get("checks_closed_upto", -1))
    events: list = [_offer_event(artifacts.experiment, o, per_partition) for o in result.offers
                    if not o.get("foreign")]
    for round_index, record, decision, version in result.merges:
        key = partition_key(artifacts.experiment, round_index, per_partition)
        events += mirrored_global_params(artifacts, key, record, decision, version,
                                         with_checks=single)
        if not single and round_index > closed:
            hold_checks(held, key, "global_params", global_params_checks(
                record, version, bool(record.get("finite", True))), round_index)
    for round_index, evaluation, previous in result.evals:
        key = partition_key(artifacts.experiment, round_index, per_partition)
        events += mirrored_eval(key, round_index, evaluation, previous, with_check=single)
        if not single and round_index > closed:
            hold_checks(held, key, "heldout_eval", [eval_regression(evaluation, previous)],
                        round_index)
    if not single:
        mirrored = min(result.state["fates"] - 1, result.state["evals"])
        released, cursor["checks_closed_upto"] = release_checks(
            held, None if result.finished else mirrored, closed)
        events += released
    events = _not_yet_evaluated(instance, events)
    requests = [_summary_request(artifacts.experiment)] if result.finished else []
    partitions = _partitions_request(artifacts.experiment, result.opened, per_partition)
    return dg.SensorResult(
        run_requests=requests, dynamic_partitions_requests=partitions, asset_events=events,
        cursor=json.dumps(cursor),
        skip_reason=None if requests or partitions or events else
        f"{holder}; round {cursor['mirror']['opened']} is the newest")


def supervise_tick(context: dg.SensorEvaluationContext, store: ArtifactStoreResource,
                   now: float | None = None) -> dg.SensorResult | dg.SkipReason:
    """One supervisor tick (the body of `learner_supervisor`)."""
    from diloco_core.config_loading import config_from_mapping

    artifacts = store.active()
    if artifacts is None:
        return dg.SkipReason("no active experiment: launch the `train` job")
    now = time.time() if now is None else now
    exp = artifacts.experiment
    config = artifacts.get_config()
    if config is None:
        return dg.SkipReason(f"experiment {exp!r} is active but has no config in the store yet")
    cfg = config_from_mapping(config)
    orch = cfg.orchestration
    state = json.loads(context.cursor) if context.cursor else {}
    if state.get("experiment") != exp:
        state = {"experiment": exp, "checkpoints": {}}
    stopping = artifacts.stop_requested() is not None
    requests, events, notes = [], [], []
    absent, partitions = _capacity(context, artifacts, cfg, notes, now)
    beats = {name: artifacts.get_heartbeat(name) for name in cfg.learners.learner_names}
    state["seen"] = observe(state.get("seen"), beats, now)
    regions = dict(zip(cfg.learners.learner_names, cfg.learners.learner_regions, strict=True))
    for name in cfg.learners.learner_names:
        beat = beats[name] or {}
        step = beat.get("checkpoint_step")
        if step is not None and state["checkpoints"].get(name) != step:
            state["checkpoints"][name] = step
            events.append(dg.AssetMaterialization(
                asset_key="learner_checkpoint", partition=learner_partition_key(exp, name),
                metadata={"step": step, "attempt": beat.get("attempt", 0),
                          "tokens_total": beat.get("tokens_total", 0),
                          "versions": dg.MetadataValue.json(beat.get("versions", [])),
                          "uri": dg.MetadataValue.path(artifacts.checkpoint_uri(name))}))
        if beat.get("status") == "done":
            continue
        records = context.instance.get_run_records(
            filters=dg.RunsFilter(job_name="learner",
                                  tags={EXPERIMENT_TAG: exp, LEARNER_TAG: name}))
        running = [rec for rec in records if rec.dagster_run.status in IN_PROGRESS]
        if running:
            hung = _hung(running[0], beat, state["seen"], name, now, orch.learner_timeout_seconds)
            if hung is not None:
                # Alive but not progressing (its heartbeat stopped changing): end the run so
                # the learner is relaunched; Pipes forwards the termination to the process.
                context.log.warning(f"{name}: terminating run {running[0].dagster_run.run_id} "
                                    f"({hung})")
                context.instance.run_coordinator.cancel_run(running[0].dagster_run.run_id)
                notes.append(f"{name}: terminated ({hung})")
            continue
        if stopping:
            continue  # the run is ending: no relaunch
        if name in absent:
            continue  # no capacity: standby, or it left (a leaving one exits by itself)
        attempt = len(records)
        blocked = _relaunch_blocked(records, orch, now)
        if blocked is not None:
            notes.append(f"{name}: {blocked}")
            continue
        requests.append(dg.RunRequest(
            job_name="learner", run_key=f"learner:{exp}:{name}:{attempt}",
            run_config={"ops": {"run_learner": {"config": {"learner": name,
                                                           "attempt": attempt}}}},
            # The region tag filters the UI's run list by where learners run.
            tags={EXPERIMENT_TAG: exp, LEARNER_TAG: name, REGION_TAG: regions[name],
                  "dagster/priority": "5"}))
    if orch.syncer == "service":
        request, note = _supervise_syncer(context, artifacts, orch, state, now)
        requests += [request] if request is not None else []
        notes += [note] if note else []
    reason = "; ".join(notes) or "every learner and the syncer have a live run"
    return dg.SensorResult(run_requests=requests, asset_events=events,
                           dynamic_partitions_requests=partitions,
                           cursor=json.dumps(state),
                           skip_reason=None if requests or events or partitions else reason)


def _capacity(context: dg.SensorEvaluationContext, artifacts, cfg, notes: list[str],
              now: float) -> tuple[frozenset[str], list]:
    """Apply the fault tape's capacity changes whose round is open, then read which learners
    are absent; and the request adding a `learners` partition for each present learner that
    has none yet (a learner that joined). A departed learner keeps its partition: its updates
    stay in the asset's history."""
    from diloco_core.capacity import CapacityError
    from pipelines.capacity_control import apply_tape
    from resources.faults import load_tape
    from resources.store.artifact_store import Conflict, RejectedArtifact

    roster = cfg.learners.learner_names
    try:
        # A tape that is malformed, or in an experiment that is not a chaos run, is refused
        # with a logged reason: never an error that would stop this tick.
        tape = load_tape(artifacts, list(roster), chaos=cfg.orchestration.chaos,
                         log=context.log.warning)
        if tape is not None and tape.capacity_changes():
            opened = (artifacts.latest_open_round() or {}).get("round")
            for note in apply_tape(artifacts, cfg, tape, opened, now):
                context.log.info(f"capacity: {note}")
                notes.append(note)
        record, _ = artifacts.capacity(cfg.learners.standby_names)
    except (CapacityError, Conflict, RejectedArtifact) as err:
        # Launch nothing on a record that cannot be read: a learner started now might have
        # to leave at once.
        notes.append(f"capacity record unreadable ({err}); launching no learner this tick")
        return frozenset(roster), []
    present = record.present(roster)
    if not record.changes:
        return frozenset(record.absent), []   # as at launch: the train job added partitions
    have = set(context.instance.get_dynamic_partitions(learners.name))
    new = [key for n in present
           if (key := learner_partition_key(artifacts.experiment, n)) not in have]
    return frozenset(record.absent), [learners.build_add_request(new)] if new else []


def _failure_streak(records: list[dg.RunRecord], healthy_seconds: float) -> int:
    """How many of the newest runs (newest first) failed in a row, counting back no further
    than the newest failed run that had been up for `healthy_seconds`: that one ended a
    healthy spell (a syncer or learner killed after minutes of work), not a crash loop, so
    the backoff starts again from its first step instead of doubling on top of old failures."""
    failures = 0
    for rec in records:
        if rec.dagster_run.status != dg.DagsterRunStatus.FAILURE:
            break
        failures += 1
        # A run that never started (no start time) was not healthy at all.
        if rec.start_time is not None and rec.end_time is not None \
                and rec.end_time - rec.start_time >= healthy_seconds:
            break
    return failures


def _relaunch_blocked(records: list[dg.RunRecord], orch, now: float) -> str | None:
    """Why a process whose runs are `records` (newest first, none in progress) is not to be
    launched again now: `max_restarts` launches within the last `restart_window_seconds`, or
    within the backoff of `restart_backoff_seconds x 2^(consecutive failures - 1)` (capped).
    A failed run that had been up for `restart_backoff_max_seconds` (longer than any backoff)
    ends the streak of consecutive failures; a slower crash loop is still held by
    `max_restarts`. None: launch it."""
    window = orch.restart_window_seconds
    recent = sorted(r.create_timestamp.timestamp() for r in records
                    if r.create_timestamp.timestamp() > now - window)
    if len(recent) > orch.max_restarts:
        wait = recent[len(recent) - orch.max_restarts - 1] + window - now
        return (f"{len(recent)} launches in the last {window:.0f}s (max_restarts "
                f"{orch.max_restarts}); the next in {wait:.0f}s")
    failures = _failure_streak(records, orch.restart_backoff_max_seconds)
    if records:
        backoff = min(orch.restart_backoff_seconds * 2 ** max(failures - 1, 0),
                      orch.restart_backoff_max_seconds)
        ended = records[0].end_time or now
        if now - ended < backoff:
            return (f"relaunch in {backoff - (now - ended):.0f}s (backoff after {failures} "
                    "failures)")
    return None


def _supervise_syncer(context: dg.SensorEvaluationContext, artifacts, orch, state: dict,
                      now: float) -> tuple[dg.RunRequest | None, str]:
    """Keep one syncer service run until the run is finished: launch it, relaunch it with
    backoff when its run failed, end it when its lease stopped moving (hung)."""
    if artifacts.finished() is not None:
        return None, ""
    exp = artifacts.experiment
    lease = artifacts.get_syncer_lease()
    state["syncer_seen"] = observe(state.get("syncer_seen"), {"syncer": lease}, now)
    records = context.instance.get_run_records(
        filters=dg.RunsFilter(job_name="syncer", tags={EXPERIMENT_TAG: exp}))
    running = [rec for rec in records if rec.dagster_run.status in IN_PROGRESS]
    if running:
        run = running[0].dagster_run
        if run.status != dg.DagsterRunStatus.STARTED:
            return None, ""
        attempt = (run.run_config.get("ops", {}).get("run_syncer", {}).get("config", {})
                   .get("attempt"))
        silent = silent_for(state["syncer_seen"], "syncer", now)
        started = running[0].start_time or running[0].create_timestamp.timestamp()
        timeout = orch.syncer_timeout_seconds
        mine = (lease or {}).get("attempt") == attempt
        # Falling back costs nothing (the sensor decides after one timeout); ending the run
        # costs a relaunch and a warm-up, so it waits for three.
        if mine and silent is not None and silent > 3 * timeout:
            hung = f"its lease has not moved for {silent:.0f}s"
        elif not mine and now - started > _first_lease_allowance(timeout) and (
                silent is None or silent > timeout):
            # Imports and the first compilation come before the lease: give it time.
            hung = f"attempt {attempt} took no lease {now - started:.0f}s after its start"
        else:
            return None, ""
        context.log.warning(f"syncer: terminating run {run.run_id} ({hung})")
        context.instance.run_coordinator.cancel_run(run.run_id)
        return None, f"syncer: terminated ({hung})"
    attempt = len(records)
    blocked = _relaunch_blocked(records, orch, now)
    if blocked is not None:
        return None, f"syncer: {blocked}"
    return dg.RunRequest(
        job_name="syncer", run_key=f"syncer:{exp}:{attempt}",
        run_config={"ops": {"run_syncer": {"config": {"attempt": attempt}}}},
        tags={EXPERIMENT_TAG: exp, SYNCER_TAG: "1", "dagster/priority": "6"}), ""


def _hung(record: dg.RunRecord, beat: dict, seen: dict, name: str, now: float,
          timeout: float) -> str | None:
    """Why a learner's in-progress run counts as hung, or None. A started run whose process
    wrote no heartbeat yet gets 3 timeouts (imports, restore, XLA compilation)."""
    run = record.dagster_run
    if run.status != dg.DagsterRunStatus.STARTED:
        return None
    attempt = (run.run_config.get("ops", {}).get("run_learner", {}).get("config", {})
               .get("attempt"))
    silent = silent_for(seen, name, now)
    if beat.get("attempt") == attempt and beat.get("status") in LIVE_STATUSES:
        if silent is not None and silent > timeout:
            return f"heartbeat unchanged for {silent:.0f}s"
        return None
    started = record.start_time or record.create_timestamp.timestamp()
    if now - started > 3 * timeout and (silent is None or silent > timeout):
        return f"no heartbeat from attempt {attempt} {now - started:.0f}s after its start"
    return None


@dg.definitions
def sensors() -> dg.Definitions:
    interval = int(os.environ.get("DILOCO_TICK_SECONDS", "5"))

    @dg.sensor(name="quorum_sensor", jobs=[merge_job, summary_job],
               minimum_interval_seconds=interval,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Opens rounds, records learner updates, decides each round with "
                           "the K-of-M quorum and adaptive grace window, and requests exactly "
                           "one merge run per round.")
    def quorum_sensor(context: dg.SensorEvaluationContext, store: ArtifactStoreResource):
        return quorum_tick(context, store)

    @dg.sensor(name="learner_supervisor", jobs=[learner, syncer],
               minimum_interval_seconds=interval,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Keeps one learner process per learner and one syncer service: "
                           "launches them, relaunches failed or hung ones with exponential "
                           "backoff, records learner checkpoints.")
    def learner_supervisor(context: dg.SensorEvaluationContext, store: ArtifactStoreResource):
        return supervise_tick(context, store)

    return dg.Definitions(sensors=[quorum_sensor, learner_supervisor])
