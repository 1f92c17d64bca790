"""Syncer dispatch: one long-lived Dagster run for the experiment's syncer service.

The `syncer` job's op hands the service (`pipelines/syncer/service.py`) to the compute
resource (a subprocess through Dagster Pipes, its log lines streamed into the run) and stays
up while it decides and merges rounds. The learner supervisor sensor launches it, relaunches
it with backoff when it fails, and ends it when its lease stops moving; the run queue's tag
limit on `diloco/syncer` and the store lease each keep a second one from committing.
"""

import dagster as dg

from pipelines.experiment_context import run_store
from resources.compute import LearnerCompute
from resources.store.resource import ArtifactStoreResource


class SyncerRunConfig(dg.Config):
    attempt: int = 0


@dg.op(description="Run the syncer service to the end of the run (Dagster Pipes).")
def run_syncer(context: dg.OpExecutionContext, config: SyncerRunConfig,
               store: ArtifactStoreResource, learner_compute: LearnerCompute):
    artifacts = run_store(context, store)
    invocation = learner_compute.launch_syncer(context, extras={
        "store": artifacts.blobs.uri, "experiment": artifacts.experiment,
        "attempt": config.attempt})
    for message in invocation.get_custom_messages():
        if isinstance(message, dict):
            context.log.info(f"syncer finished: {message.get('status')}, "
                             f"{message.get('merged')} rounds merged")


@dg.job(executor_def=dg.in_process_executor,
        description="The syncer service (dispatched by the learner supervisor sensor): decides "
                    "and merges rounds within a second, fenced by a lease in the store.")
def syncer():
    run_syncer()
