"""The `stop` job: the UI's way to end a run cleanly before its budget
(`pipelines/run_control.py`; the same as `diloco stop`)."""

import dagster as dg
import pydantic

from pipelines.experiment_context import run_store
from resources.store.resource import ArtifactStoreResource


class StopConfig(dg.Config):
    reason: str = pydantic.Field(default="", description="Why (kept in the STOP record).")


@dg.op(description="Ask the active experiment (or the one in the run's diloco/experiment tag) "
                   "to stop at the next round boundary: final rounds, then the summary.")
def request_run_stop(context: dg.OpExecutionContext, config: StopConfig,
                     store: ArtifactStoreResource) -> None:
    from pipelines.run_control import request_stop

    artifacts = run_store(context, store)
    who = context.run.tags.get("dagster/user") or f"Dagster run {context.run_id[:8]}"
    context.log.info(request_stop(artifacts, who, config.reason))


@dg.job(executor_def=dg.in_process_executor,
        description="End the training run cleanly before its token budget: the syncer writes "
                    "STOP at its next tick, the final rounds merge, the summary is written.")
def stop():
    request_run_stop()
