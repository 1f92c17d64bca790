"""Which experiment a Dagster run works on: its `diloco/experiment` tag, else the experiment
its partition belongs to (round and learner partition keys start with it), else the active one.
A tag and a partition that name different experiments are refused."""

import dagster as dg

from resources.store.artifact_store import ArtifactStore
from resources.store.resource import ArtifactStoreResource

EXPERIMENT_TAG = "diloco/experiment"


def run_store(context: dg.AssetExecutionContext | dg.OpExecutionContext,
              store: ArtifactStoreResource) -> ArtifactStore:
    name = context.run.tags.get(EXPERIMENT_TAG)
    partition = _partition_experiment(context)
    if name and partition and name != partition:
        raise dg.Failure(description=f"the run's {EXPERIMENT_TAG} tag names experiment "
                                     f"{name!r} but its partition belongs to {partition!r}")
    name = name or partition
    if name:
        return store.store(name)
    active = store.active()
    if active is None:
        raise dg.Failure(description=f"no experiment is active in {store.base_uri} and the run "
                                     f"has no {EXPERIMENT_TAG} tag: launch the `train` job first")
    return active


def _partition_experiment(context) -> str | None:
    if not context.has_partition_key:
        return None
    from pipelines.partition_keys import partition_experiment

    key = context.partition_key
    if isinstance(key, dg.MultiPartitionKey):
        key = key.keys_by_dimension.get("round", "")
    return partition_experiment(str(key)) or None
