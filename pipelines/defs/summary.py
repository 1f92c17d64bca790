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
    written = artifacts.get_summary() or {}
    summary = {**build_summary(artifacts, evals=written.get("evals")),
               "summarized_by": ArtifactStore.SUMMARY_RECORDED_BY}
    artifacts.put_summary(summary)
    active = store.active()
    if active is not None and active.experiment == artifacts.experiment:
        store.set_active(None)  # the sensors go quiet until the next `train`
    context.log.info(f"{summary['rounds_merged']} rounds merged; held-out loss "
                     f"{summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f}")
    return dg.MaterializeResult(metadata={
        "rounds_merged": summary["rounds_merged"],
        "initial_eval_loss": summary["initial_eval_loss"],
        "final_eval_loss": summary["final_eval_loss"],
        "tokens": summary["tokens"], "uptime": summary["uptime"],
        "learner_idle_fraction": summary["learner_idle_fraction"],
        "learners_rejoined": ", ".join(summary["learners_rejoined"]) or "none",
        "summary": dg.MetadataValue.json(summary),
    })


summary_job = dg.define_asset_job("summarize", selection=[run_summary],
                                  executor_def=dg.in_process_executor)
