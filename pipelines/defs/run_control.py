"""Run control from the UI: the `stop` job ends a run cleanly before its budget
(`pipelines/run_control.py`; the same as `diloco stop`), the `capacity` job adds learners to a
running experiment or releases them (`pipelines/capacity_control.py`; `diloco capacity`)."""

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
    who = context.run.tags.get("dagster/user") or f"Dagster run {context.run.run_id[:8]}"
    context.log.info(request_stop(artifacts, who, config.reason))


@dg.job(executor_def=dg.in_process_executor,
        description="End the training run cleanly before its token budget: the syncer writes "
                    "STOP at its next tick, the final rounds merge, the summary is written.")
def stop():
    request_run_stop()


class CapacityConfig(dg.Config):
    join: list[str] = pydantic.Field(
        default_factory=list, description="Learners of the roster that get compute now: the "
        "learner supervisor launches them at its next tick (from the current global "
        "parameters and a peer's AdamW state, on their own data shards).")
    leave: list[str] = pydantic.Field(
        default_factory=list, description="Learners whose compute is reclaimed: they offer "
        "what they have to the coming rounds, exit, and are not relaunched.")
    reason: str = pydantic.Field(default="", description="Why (kept in the capacity record).")


@dg.op(description="Change which learners of the active experiment (or the one in the run's "
                   "diloco/experiment tag) have compute.")
def change_run_capacity(context: dg.OpExecutionContext, config: CapacityConfig,
                        store: ArtifactStoreResource) -> None:
    from diloco_core.capacity import CapacityError
    from diloco_core.config_loading import config_from_mapping
    from pipelines.capacity_control import change_capacity, describe

    artifacts = run_store(context, store)
    cfg = config_from_mapping(artifacts.get_config())
    who = context.run.tags.get("dagster/user") or f"Dagster run {context.run.run_id[:8]}"
    try:
        record = change_capacity(artifacts, cfg, join=config.join, leave=config.leave,
                                 requested_by=who, reason=config.reason)
    except CapacityError as err:
        raise dg.Failure(description=f"capacity not changed: {err}") from None
    context.log.info(describe(record, cfg))


@dg.job(executor_def=dg.in_process_executor,
        description="Scavenged capacity: add learners of the roster to the running experiment "
                    "or release them; the learner supervisor and the learners act on it.")
def capacity():
    change_run_capacity()
