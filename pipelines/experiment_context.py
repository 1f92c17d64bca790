"""Which experiment a Dagster run works on: its `diloco/experiment` tag, else the active one."""

import dagster as dg

from resources.store.artifact_store import ArtifactStore
from resources.store.resource import ArtifactStoreResource

EXPERIMENT_TAG = "diloco/experiment"


def run_store(context: dg.AssetExecutionContext | dg.OpExecutionContext,
              store: ArtifactStoreResource) -> ArtifactStore:
    name = context.run.tags.get(EXPERIMENT_TAG)
    if name:
        return store.store(name)
    active = store.active()
    if active is None:
        raise dg.Failure(description=f"no experiment is active in {store.base_uri} and the run "
                                     f"has no {EXPERIMENT_TAG} tag: launch the `train` job first")
    return active
