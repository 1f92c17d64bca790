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

from pipelines.defs.learners import learner
from pipelines.defs.partitions import (
    FRAGMENT_TAG,
    LEARNER_TAG,
    MERGE_TAG,
    REGION_TAG,
    ROUND_TAG,
    rounds,
)
from pipelines.defs.rounds import merge_job
from pipelines.defs.summary import summary_job
from pipelines.experiment_context import EXPERIMENT_TAG
from pipelines.liveness import LIVE_STATUSES, observe, silent_for
from pipelines.round_control import RoundController, round_key
from resources.store.resource import ArtifactStoreResource

IN_PROGRESS = {dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
               dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
               dg.DagsterRunStatus.CANCELING}


def _offer_event(offer: dict) -> dg.AssetMaterialization:
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
        partition=dg.MultiPartitionKey({"round": round_key(offer["round"]),
                                        "learner": offer["learner"]}),
        description="late: offered after its round was decided" if offer["late"] else None,
        metadata=metadata)


def quorum_tick(context: dg.SensorEvaluationContext, store: ArtifactStoreResource
                ) -> dg.SensorResult | dg.SkipReason:
    """One quorum tick (the body of `quorum_sensor`; tests call it directly)."""
    artifacts = store.active()
    if artifacts is None:
        return dg.SkipReason("no active experiment: launch the `train` job")
    from diloco_core.config_loading import config_from_mapping

    config = artifacts.get_config()
    if config is None:
        return dg.SkipReason(f"experiment {artifacts.experiment!r} is active but has no config "
                             "in the store yet")
    state = json.loads(context.cursor) if context.cursor else None
    result = RoundController(artifacts, config_from_mapping(config)).tick(state)
    exp = artifacts.experiment
    requests = [dg.RunRequest(job_name="merge_round", partition_key=round_key(d["round"]),
                              run_key=f"merge:{exp}:{d['round']}",
                              tags={EXPERIMENT_TAG: exp, ROUND_TAG: str(d["round"]),
                                    FRAGMENT_TAG: str(d["fragment"]), MERGE_TAG: "1",
                                    "dagster/max_retries": "3"})
                for d in result.merges]
    if result.finished:
        requests.append(dg.RunRequest(job_name="summarize", run_key=f"summary:{exp}",
                                      tags={EXPERIMENT_TAG: exp, "dagster/max_retries": "3"}))
    for offer in result.offers:
        if offer.get("foreign"):
            context.log.warning(f"ignored an offer to round {offer['round']} from "
                                f"{offer['learner']!r}: {offer['problem']}")
    partitions = ([rounds.build_add_request([round_key(r) for r in result.opened])]
                  if result.opened else [])
    return dg.SensorResult(
        run_requests=requests, dynamic_partitions_requests=partitions,
        asset_events=[_offer_event(o) for o in result.offers if not o.get("foreign")],
        cursor=json.dumps(result.state),
        skip_reason=None if requests or partitions or result.offers else result.reason)


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
    beats = {name: artifacts.get_heartbeat(name) for name in cfg.learners.learner_names}
    state["seen"] = observe(state.get("seen"), beats, now)
    regions = dict(zip(cfg.learners.learner_names, cfg.learners.learner_regions, strict=True))
    for name in cfg.learners.learner_names:
        beat = beats[name] or {}
        step = beat.get("checkpoint_step")
        if step is not None and state["checkpoints"].get(name) != step:
            state["checkpoints"][name] = step
            events.append(dg.AssetMaterialization(
                asset_key="learner_checkpoint", partition=name,
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
        attempt = len(records)
        if attempt > orch.max_restarts:
            notes.append(f"{name}: gave up after {attempt} launches")
            continue
        failures = 0
        for rec in records:  # newest first
            if rec.dagster_run.status != dg.DagsterRunStatus.FAILURE:
                break
            failures += 1
        if records:
            backoff = min(orch.restart_backoff_seconds * 2 ** max(failures - 1, 0),
                          orch.restart_backoff_max_seconds)
            ended = records[0].end_time or now
            if now - ended < backoff:
                notes.append(f"{name}: relaunch in {backoff - (now - ended):.0f}s "
                             f"(backoff after {failures} failures)")
                continue
        requests.append(dg.RunRequest(
            job_name="learner", run_key=f"learner:{exp}:{name}:{attempt}",
            run_config={"ops": {"run_learner": {"config": {"learner": name,
                                                           "attempt": attempt}}}},
            # The region tag filters the UI's run list by where learners run.
            tags={EXPERIMENT_TAG: exp, LEARNER_TAG: name, REGION_TAG: regions[name],
                  "dagster/priority": "5"}))
    reason = "; ".join(notes) or "every learner has a live run"
    return dg.SensorResult(run_requests=requests, asset_events=events,
                           cursor=json.dumps(state),
                           skip_reason=None if requests or events else reason)


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

    @dg.sensor(name="learner_supervisor", job=learner, minimum_interval_seconds=interval,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Keeps one learner process per learner: launches them, relaunches "
                           "failed ones with exponential backoff, records their checkpoints.")
    def learner_supervisor(context: dg.SensorEvaluationContext, store: ArtifactStoreResource):
        return supervise_tick(context, store)

    return dg.Definitions(sensors=[quorum_sensor, learner_supervisor])
