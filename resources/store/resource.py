"""The artifact store as a Dagster resource: a local directory by default, gs:// in the cloud."""

import dagster as dg

from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store


class ArtifactStoreResource(dg.ConfigurableResource):
    """Where one experiment's artifacts live. `base_uri` is a path or gs://bucket/prefix; set it
    per deployment (e.g. `dg.EnvVar("DILOCO_STORE_URI")`); credentials come from ADC."""

    base_uri: str = "runs/store"
    experiment: str = "diloco-demo"

    def store(self) -> ArtifactStore:
        return ArtifactStore(open_blob_store(self.base_uri), self.experiment)
