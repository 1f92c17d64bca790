"""The artifact store as a Dagster resource: a local directory by default, gs:// in the cloud."""

import dagster as dg

from resources.store.artifact_store import ArtifactStore, active_experiment, set_active_experiment
from resources.store.backends import open_blob_store
from resources.store.blobs import BlobStore


class ArtifactStoreResource(dg.ConfigurableResource):
    """Where experiments' artifacts live. `base_uri` is a path or gs://bucket/prefix; set it per
    deployment (e.g. `dg.EnvVar("DILOCO_STORE_URI")`); credentials come from ADC.

    `experiment` names the default experiment; the orchestration follows the experiment marked
    active in the store (set by the `train` job) unless a run names one in its tags.
    """

    base_uri: str = "runs/store"
    experiment: str = "diloco-demo"

    def blobs(self) -> BlobStore:
        return open_blob_store(self.base_uri)

    def store(self, experiment: str | None = None) -> ArtifactStore:
        return ArtifactStore(self.blobs(), experiment or self.experiment)

    def active(self) -> ArtifactStore | None:
        """The experiment the sensors drive, or None when no run is active."""
        blobs = self.blobs()
        name = active_experiment(blobs)
        return None if name is None else ArtifactStore(blobs, name)

    def set_active(self, experiment: str | None) -> None:
        set_active_experiment(self.blobs(), experiment)
