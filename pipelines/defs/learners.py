"""Learner dispatch: one long-lived Dagster run per learner process.

The `learner` job's op hands the learner to its compute resource (a local subprocess through
Dagster Pipes by default) and stays up while it trains, streaming its log lines into the run.
The learner supervisor sensor launches one run per learner, relaunches failed ones with
backoff, and the run queue's tag limit (`diloco/learner`, one per value) guarantees at most one
process per learner even if two requests raced.
"""

import dagster as dg

from pipelines.experiment_context import run_store
from resources.compute import LearnerCompute
from resources.store.resource import ArtifactStoreResource


class LearnerRunConfig(dg.Config):
    learner: str
    attempt: int = 0


@dg.op(description="Run one learner process to completion on its compute (Dagster Pipes).")
def run_learner(context: dg.OpExecutionContext, config: LearnerRunConfig,
                store: ArtifactStoreResource, learner_compute: LearnerCompute):
    from diloco_core.config_loading import config_from_mapping

    artifacts = run_store(context, store)
    learners_cfg = config_from_mapping(artifacts.get_config()).learners
    if config.learner not in learners_cfg.learner_names:
        raise dg.Failure(description=f"{config.learner!r} is not a learner of experiment "
                                     f"{artifacts.experiment!r}")
    region = learners_cfg.learner_regions[learners_cfg.learner_names.index(config.learner)]
    invocation = learner_compute.launch(context, region=region, extras={
        "store": artifacts.blobs.uri, "experiment": artifacts.experiment,
        "learner": config.learner, "attempt": config.attempt})
    for message in invocation.get_custom_messages():
        if isinstance(message, dict):
            context.log.info(f"{config.learner} finished: {message.get('status')} at step "
                             f"{message.get('step')}, {message.get('offers')} offers, "
                             f"{message.get('received')} merged fragments received")


@dg.job(executor_def=dg.in_process_executor,
        description="One learner process (dispatched by the learner supervisor sensor).")
def learner():
    run_learner()
