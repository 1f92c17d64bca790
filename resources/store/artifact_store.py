"""The artifact store: one experiment's config, global fragments, contributions, decisions, evals.

Same code over a local directory or a GCS prefix (any `BlobStore`). The rules that make it safe:
- payload objects are written once, create-only, under names that carry their checksum;
- a small JSON manifest is written last, create-only, and is the commit point: readers look only
  at manifests, verify every object's size and SHA-256, and parse arrays without unpickling;
- a fragment's current version is a pointer moved by compare-and-swap on its generation, only
  after the new version is fully committed, so nothing partial is ever visible;
- writing the same thing twice is a no-op; writing something different where something is
  committed is refused (`Conflict`).
See `layout.py` for the keys.

JAX is imported only where arrays are handled: sensors and run workers that load the Dagster
code location only read and write small records and should not pay for it.
"""

from resources.store.global_versions import GlobalFragment, GlobalVersions
from resources.store.learner_records import LearnerRecords
from resources.store.round_store import RoundStore
from resources.store.run_records import RunRecords, active_experiment, set_active_experiment
from resources.store.store_base import (
    DEFAULT_MAX_OBJECT_BYTES,
    MAX_RECORD_BYTES,
    Conflict,
    Pruned,
    RejectedArtifact,
)

__all__ = ["DEFAULT_MAX_OBJECT_BYTES", "MAX_RECORD_BYTES", "ArtifactStore", "Conflict",
           "GlobalFragment", "Pruned", "RejectedArtifact", "active_experiment",
           "set_active_experiment"]


class ArtifactStore(GlobalVersions, RoundStore, LearnerRecords, RunRecords):
    """One experiment's artifacts in a blob store: the record families composed (each in its
    own module, on `StoreBase`'s primitives). The control plane uses all of it; a learner's
    write rules (`access.py`) allow only its own records and contributions."""
