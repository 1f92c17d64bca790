"""Where a driver may step into the syncer's merges: the chaos harness's only way in.

The syncer's own behaviour is the no-op below. A chaos run's syncer entry (and the Dagster merge
asset) pass the fault tape's injectors instead (`resources.chaos.faults.SyncerFaults`, which
has the same methods), so the service and the merge never import fault injection.
"""

from resources.store.artifact_store import ArtifactStore


class MergeHooks:
    """One round's merge: the store it reads and writes through, and the points of its commit
    (`before_commit`, `during_commit`, `after_commit`) where a chaos run may crash it."""

    def wrap_store(self, store: ArtifactStore) -> ArtifactStore:
        return store

    def at(self, phase: str) -> None:
        """Called at each phase of the commit."""


class SyncerHooks:
    """The syncer service: called before it merges a round, and for that merge's hooks."""

    def before_merge(self, round_index: int) -> None:
        """Called as the service is about to merge `round_index`."""

    def merge(self, round_index: int) -> MergeHooks:
        return MergeHooks()
