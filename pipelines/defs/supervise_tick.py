"""One tick of the learner supervisor: keep one learner process per learner and one syncer
service running, relaunch failed or hung ones with backoff, follow the capacity record."""

import json
import time

import dagster as dg

from diloco_core.liveness import LIVE_STATUSES, observe, silent_for
from diloco_core.round_records import Heartbeat
from pipelines.defs.partitions import (
    LEARNER_TAG,
    REGION_TAG,
    SYNCER_TAG,
    learners,
)
from pipelines.defs.quorum_tick import IN_PROGRESS, first_lease_allowance
from pipelines.experiment_context import EXPERIMENT_TAG
from pipelines.partition_keys import learner_partition_key
from resources.store.resource import ArtifactStoreResource


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
    state["seen"] = observe(state.get("seen"), {
        name: None if beat is None else beat.to_json() for name, beat in beats.items()}, now)
    regions = dict(zip(cfg.learners.learner_names, cfg.learners.learner_regions, strict=True))
    for name in cfg.learners.learner_names:
        beat = beats[name]
        step = None if beat is None else beat.checkpoint_step
        if beat is not None and step is not None and state["checkpoints"].get(name) != step:
            state["checkpoints"][name] = step
            events.append(dg.AssetMaterialization(
                asset_key="learner_checkpoint", partition=learner_partition_key(exp, name),
                metadata={"step": step, "attempt": beat.attempt,
                          "tokens_total": beat.tokens_total,
                          "versions": dg.MetadataValue.json(list(beat.versions)),
                          "uri": dg.MetadataValue.path(artifacts.checkpoint_uri(name))}))
        if beat is not None and beat.status == "done":
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
    from resources.chaos.faults import load_tape
    from resources.store.artifact_store import Conflict, RejectedArtifact

    roster = cfg.learners.learner_names
    try:
        # A tape that is malformed, or in an experiment that is not a chaos run, is refused
        # with a logged reason: never an error that would stop this tick.
        tape = load_tape(artifacts, list(roster), chaos=cfg.orchestration.chaos,
                         log=context.log.warning)
        if tape is not None and tape.capacity_changes():
            latest = artifacts.latest_open_round()
            opened = None if latest is None else latest.round
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
    state["syncer_seen"] = observe(state.get("syncer_seen"),
                                   {"syncer": None if lease is None else lease.to_json()}, now)
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
        mine = lease is not None and lease.attempt == attempt
        # Falling back costs nothing (the sensor decides after one timeout); ending the run
        # costs a relaunch and a warm-up, so it waits for three.
        if mine and silent is not None and silent > 3 * timeout:
            hung = f"its lease has not moved for {silent:.0f}s"
        elif not mine and now - started > first_lease_allowance(timeout) and (
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


def _hung(record: dg.RunRecord, beat: Heartbeat | None, seen: dict, name: str, now: float,
          timeout: float) -> str | None:
    """Why a learner's in-progress run counts as hung, or None. A started run whose process
    wrote no heartbeat yet gets 3 timeouts (imports, restore, XLA compilation)."""
    run = record.dagster_run
    if run.status != dg.DagsterRunStatus.STARTED:
        return None
    attempt = (run.run_config.get("ops", {}).get("run_learner", {}).get("config", {})
               .get("attempt"))
    silent = silent_for(seen, name, now)
    if beat is not None and beat.attempt == attempt and beat.status in LIVE_STATUSES:
        if silent is not None and silent > timeout:
            return f"heartbeat unchanged for {silent:.0f}s"
        return None
    started = record.start_time or record.create_timestamp.timestamp()
    if now - started > 3 * timeout and (silent is None or silent > timeout):
        return f"no heartbeat from attempt {attempt} {now - started:.0f}s after its start"
    return None
