"""The run summary: requested by the quorum sensor once the final rounds are merged.

The syncer service usually wrote the summary already (as soon as the final rounds were merged
and the learners had ended): this run records it as an asset, reusing the syncer's evals
where they saw the final versions, and builds it from the store alone where no syncer did
(the sensor fallback)."""

import dagster as dg

from pipelines.experiment_context import run_store
from resources.store.artifact_store import ArtifactStore
from resources.store.resource import ArtifactStoreResource


@dg.asset(group_name="evals", kinds={"jax"}, deps=["heldout_eval"],
          description="The whole run at a glance: rounds merged, initial and final held-out "
                      "loss, tokens, uptime, learner idle time, rejoins, per-round decisions.")
def run_summary(context: dg.AssetExecutionContext, store: ArtifactStoreResource):
    from pipelines.run_summary import build_summary

    artifacts = run_store(context, store)
    written = artifacts.get_summary()
    summary = build_summary(artifacts, evals=None if written is None else written.evals)
    summary = summary.model_copy(update={"summarized_by": ArtifactStore.SUMMARY_RECORDED_BY})
    artifacts.put_summary(summary)
    active = store.active()
    if active is not None and active.experiment == artifacts.experiment:
        store.set_active(None)  # the sensors go quiet until the next `train`
    outcome = summary.outcome
    context.log.info(f"{outcome.rounds_merged} rounds merged; held-out loss "
                     f"{outcome.initial_eval_loss:.3f} -> {outcome.final_eval_loss:.3f}")
    return dg.MaterializeResult(metadata={
        "rounds_merged": outcome.rounds_merged,
        "initial_eval_loss": outcome.initial_eval_loss,
        "final_eval_loss": outcome.final_eval_loss,
        "tokens": outcome.tokens, "uptime": summary.timing.uptime,
        "learner_idle_fraction": summary.learners.learner_idle_fraction,
        "learners_rejoined": ", ".join(summary.learners.learners_rejoined) or "none",
        "summary": dg.MetadataValue.json(summary.to_json()),
    })


summary_job = dg.define_asset_job("summarize", selection=[run_summary],
                                  executor_def=dg.in_process_executor)
