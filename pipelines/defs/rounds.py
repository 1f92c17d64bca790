"""Rounds as assets: learner updates (observed), merged global parameters, held-out evals.

- `learner_update` [round x learner] is observed, not computed here: learners commit their
  contributions to the store on their own schedule and the quorum sensor records each one as a
  materialization with its metadata (tokens, steps, bytes, encoding, staleness, train loss).
- `global_params` [round] is the merge of that round (run by the quorum sensor, one run per
  round). It reads the previous version through the store (Dagster cannot express a dynamic
  partition depending on its predecessor) and records it in metadata.
- `heldout_eval` [round] evaluates the global model right after each merge, in the same run;
  the `eval_latest_round` schedule re-evaluates the newest round with more batches.
"""

import dagster as dg

from pipelines.defs.partitions import ROUND_TAG, learners, round_x_learner, rounds
from pipelines.experiment_context import EXPERIMENT_TAG, run_store
from pipelines.partition_keys import partition_key, partition_rounds
from pipelines.round_metadata import (
    eval_regression,
    global_params_events,
    global_params_metadata,
    heldout_eval_metadata,
    round_scalars,
)
from resources.store.resource import ArtifactStoreResource

# No storage kind: the store is the deployment's choice (a local directory or a GCS bucket),
# and a badge the definitions fix would be wrong for one of them.
learner_update = dg.AssetSpec(
    "learner_update", partitions_def=round_x_learner, group_name="diloco", kinds={"jax"},
    deps=["initial_params"],
    description="A learner's contribution to a round: its encoded outer gradient for the "
                "round's fragment, with tokens and steps since it last received that fragment. "
                "Written by the learner process; recorded here by the quorum sensor.")

learner_checkpoint = dg.AssetSpec(
    "learner_checkpoint", partitions_def=learners, group_name="diloco",
    kinds={"orbax"}, deps=["initial_params"],
    description="A learner's latest restorable Orbax checkpoint (params, AdamW state, data "
                "position, fragment anchors). Recorded by the learner supervisor.")


def run_round(context: dg.AssetExecutionContext) -> int:
    """The round a run works on: its `diloco/round` tag (the sensor and the schedule set it),
    else the partition's only round. A partition holding several rounds
    (`orchestration.rounds_per_partition`) needs the tag to say which."""
    held = partition_rounds(context.partition_key)
    tag = context.run.tags.get(ROUND_TAG)
    if tag is None:
        if len(held) == 1:
            return held[0]
        raise dg.Failure(description=(
            f"partition {context.partition_key} holds rounds {held[0]}-{held[-1]}: launch the "
            f"run with the tag {ROUND_TAG}=<round> to say which"))
    if not tag.isdigit() or int(tag) not in held:
        raise dg.Failure(description=f"tag {ROUND_TAG}={tag[:20]!r} is not a round of "
                                     f"partition {context.partition_key}")
    return int(tag)


def _to_metrics_sink(context: dg.AssetExecutionContext, artifacts, round_index: int,
                     scalars) -> None:
    """This run's figures for the experiment's TensorBoard sink, if it has one."""
    from diloco_core.config_loading import config_from_mapping
    from resources.metrics_sink import open_sink

    logdir = config_from_mapping(artifacts.get_config()).orchestration.tensorboard_dir
    sink = open_sink(logdir, artifacts.experiment, f"run-{context.run.run_id[:8]}",
                     context.log.warning)
    if sink is not None:
        sink.scalars(round_index, scalars())
        sink.close()


def _merge_faults(artifacts, round_index: int, log: dg.DagsterLogManager):
    """A chaos run's faults for this merge (none unless the experiment has a fault tape)."""
    from resources.chaos.faults import syncer_faults

    faults = syncer_faults(artifacts, log)
    return None if faults is None else faults.merge(round_index)


@dg.asset(
    partitions_def=rounds, group_name="diloco", kinds={"jax", "optax"},
    deps=[dg.AssetDep(learner_update, partition_mapping=dg.MultiToSingleDimensionPartitionMapping(
        partition_dimension_name="round")), "initial_params"],
    check_specs=[
        dg.AssetCheckSpec("params_finite", asset="global_params", blocking=True,
                          description="The merged fragment is finite; otherwise it is not "
                                      "committed and the round's eval does not run."),
        dg.AssetCheckSpec("contribution_norms", asset="global_params",
                          description="No admitted contribution had an outer-gradient norm "
                                      "outside the robust range (those are excluded)."),
    ],
    description="The global parameters after merging one round: the round's fragment at its "
                "new version, merged from the admitted contributions (token-weighted RDA, "
                "outer Nesterov), committed atomically through the store.")
def global_params(context: dg.AssetExecutionContext, store: ArtifactStoreResource):
    from pipelines.syncer.store_merge import MergeInputError, merge_from_store

    artifacts = run_store(context, store)
    round_index = run_round(context)
    try:
        outcome = merge_from_store(artifacts, round_index,
                                   _merge_faults(artifacts, round_index, context.log))
    except MergeInputError as err:
        raise dg.Failure(description=str(err)) from None
    record, decision = outcome.record, outcome.decision
    if outcome.already_committed:
        context.log.info(f"round {round_index} was already committed as version "
                         f"{outcome.version}; not merging twice")
    else:
        context.log.info(f"round {round_index}: {record.reason}")
        _to_metrics_sink(context, artifacts, round_index, lambda: round_scalars(
            global_params_metadata(artifacts, record, decision, outcome.version,
                                   outcome.finite, outcome.seconds)))
    yield from global_params_events(artifacts, record, decision, outcome.version,
                                    outcome.finite, outcome.seconds)


class EvalConfig(dg.Config):
    batches: int = 0      # 0: the experiment's orchestration.eval_batches


@dg.asset(
    partitions_def=rounds, group_name="evals", kinds={"jax"}, deps=[global_params],
    check_specs=[dg.AssetCheckSpec("eval_regression", asset="heldout_eval",
                                   description="Held-out loss did not rise more than 5% over "
                                               "the previous evaluated round.")],
    description="Held-out loss, bits per byte and a short greedy sample of the global model "
                "right after the round's merge.")
def heldout_eval(context: dg.AssetExecutionContext, config: EvalConfig,
                 store: ArtifactStoreResource):
    from pipelines.round_eval import evaluate_global
    from resources.store.artifact_store import Conflict
    from resources.store.summary_records import RoundEval

    artifacts = run_store(context, store)
    round_index = run_round(context)
    result = evaluate_global(artifacts, config.batches or None)
    standard = (artifacts.get_config() or {}).get("orchestration", {}).get("eval_batches")
    if result.batches != standard:
        # The store's per-round evals are one series (the progress line, the run's curves, the
        # regression check read it): an eval on other held-out batches would sit in it as a
        # jump. The soak's curve once showed a 16-batch eval 0.6 below its 4-batch neighbours.
        context.log.info(f"round {round_index}: a {result.batches}-batch eval is recorded in "
                         f"Dagster only; the store keeps the {standard}-batch series")
    else:
        try:
            artifacts.put_eval(round_index, RoundEval(**dict(result)))
        except Conflict:
            context.log.info(f"round {round_index} already has an eval in the store; this one "
                             "(newer versions) is recorded in Dagster only")
    previous = None
    for earlier in range(round_index - 1, max(-1, round_index - 50), -1):
        previous = artifacts.get_eval(earlier)
        if previous is not None:
            break
    context.log.info(f"round {round_index}: held-out loss {result.loss:.4f}")
    _to_metrics_sink(context, artifacts, round_index, lambda: {
        "eval/loss": result.loss, "eval/bits_per_byte": result.bits_per_byte})
    yield dg.MaterializeResult(metadata=heldout_eval_metadata(result, round_index))
    yield dg.AssetCheckResult(**eval_regression(result, previous)._asdict())


merge_job = dg.define_asset_job(
    "merge_round", selection=[global_params, heldout_eval],
    executor_def=dg.in_process_executor, tags={"dagster/priority": "10"},
    description="Merge one decided round and evaluate the result (requested by the quorum "
                "sensor, one run per round).")

eval_job = dg.define_asset_job(
    "evaluate_round", selection=[heldout_eval],
    executor_def=dg.in_process_executor, description="Re-evaluate one round's global model.")


@dg.schedule(cron_schedule="*/30 * * * *", target=eval_job, execution_timezone="UTC",
             default_status=dg.DefaultScheduleStatus.RUNNING)
def eval_latest_round(context: dg.ScheduleEvaluationContext, store: ArtifactStoreResource):
    """Every 30 minutes, a longer eval of the active experiment's newest merged round."""
    artifacts = store.active()
    if artifacts is None:
        # A finished run clears the active experiment: nothing is training, nothing to do.
        return dg.SkipReason("no experiment is active")
    config = artifacts.get_config() or {}
    fragments = ((config.get("sync") or {}).get("num_fragments"))
    metas = [artifacts.version_meta(p)
             for p in range(fragments if isinstance(fragments, int) else 0)]
    merged = [m.round for m in metas if m is not None and m.round is not None]
    if not merged:
        return dg.SkipReason(f"{artifacts.experiment}: no merged round yet")
    from diloco_core.config_loading import config_from_mapping

    latest = max(merged)
    key = partition_key(artifacts.experiment, latest,
                        config_from_mapping(config).rounds_per_partition)
    if not context.instance.has_dynamic_partition(rounds.name, key):
        return dg.SkipReason(f"{artifacts.experiment}: round {latest} is not yet a partition")
    when = context.scheduled_execution_time
    stamp = when.strftime("%Y%m%dT%H%M") if when else "now"
    return dg.RunRequest(
        partition_key=key, run_key=f"eval:{artifacts.experiment}:{latest}:{stamp}",
        tags={EXPERIMENT_TAG: artifacts.experiment, ROUND_TAG: str(latest)},
        run_config={"ops": {"heldout_eval": {"config": {"batches": 16}}}})
