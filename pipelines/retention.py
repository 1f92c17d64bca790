"""Retention: a long run keeps the arrays it can still use and deletes the rest.

At the paper's cadence a run commits one global version per fragment round and up to M
contributions per round; for a 12B model each is gigabytes, and a month makes millions. The
syncer service applies the experiment's policy (`orchestration.keep_global_versions`,
`orchestration.keep_contribution_rounds`) after each merge it commits: the arrays of the
versions and rounds that fell out of the window are deleted, their manifests and records stay
(see `ArtifactStore.prune_version`). How far it got is a record in the store, so a relaunched
syncer carries on where its predecessor stopped; redoing a step is harmless (pruning twice
deletes nothing the second time).

Bounded work per merge (`MAX_PRUNES_PER_MERGE`): a policy tightened mid-run, or an experiment
from before retention, is caught up over the following merges instead of stalling one.
While the quorum sensor stands in for a dead syncer nothing is pruned; the next syncer
catches up.

The records of pruned rounds are then packed, a block of rounds at a time, into one archive
object each, and deleted (`resources/store/record_archive.py`; `ARCHIVE_STEPS_PER_MERGE`):
readers find them there, and the store holds a fixed number of objects per round in flight
instead of twenty per round ever run. Each block also carries the token ledger's digest of its
rounds (`pipelines.token_ledger.ledger_digest`), so the ledger at the end of a run reads one
object per 64 rounds beyond retention instead of parsing every record of each.
"""

from dataclasses import dataclass

from diloco_core.config import ExperimentConfig
from pipelines.token_ledger import ledger_digest
from resources.store.artifact_store import ArtifactStore, Conflict
from resources.store.record_archive import RecordArchiver

MAX_PRUNES_PER_MERGE = 8
# Rounds packed into archive blocks, or their records deleted once packed, per merge: a round
# of records takes two such steps, so four a merge keep up with a round a merge and catch up.
ARCHIVE_STEPS_PER_MERGE = 4


@dataclass
class Retention:
    store: ArtifactStore
    cfg: ExperimentConfig
    versions_from: list[int]    # per fragment: every version below it has been pruned
    rounds_from: int            # every round below it has been pruned
    # Pack the records of pruned rounds (of each fragment's pruned versions) into blocks
    # (`record_archive.py`); None when they are kept whole (keep_... = 0).
    archiver: RecordArchiver | None = None
    version_archivers: list[RecordArchiver] | None = None

    @classmethod
    def resume(cls, store: ArtifactStore, cfg: ExperimentConfig) -> "Retention":
        """From the store's record, or from the start (version 1, round 0) without one. The
        record is the syncer's own, but read like any record: a malformed one starts over."""
        num = cfg.sync.num_fragments
        record = store.get_retention() or {}
        versions, rounds = record.get("versions_from"), record.get("rounds_from")
        if not (isinstance(versions, list) and len(versions) == num
                and all(_count(v) for v in versions)):
            versions = [1] * num
        orch = cfg.orchestration
        learners = cfg.learners.learner_names
        # Each block of rounds carries the token ledger's digest of them: a run's ledger then
        # reads a block's answers instead of every record of its 64 rounds.
        archiver = (RecordArchiver(store.archive, learners,
                                   digest=ledger_digest(store, learners))
                    if orch.keep_contribution_rounds else None)
        version_archivers = ([RecordArchiver(store.version_archive(p)) for p in range(num)]
                             if orch.keep_global_versions else None)
        return cls(store, cfg, [max(1, v) for v in versions],
                   rounds if _count(rounds) else 0, archiver, version_archivers)

    def after_merge(self, fragment: int, version: int, round_index: int) -> int:
        """Prune what the commit of `version` of `fragment` for `round_index` pushed out of
        the window; returns the objects deleted."""
        orch = self.cfg.orchestration
        budget, deleted, moved = MAX_PRUNES_PER_MERGE, 0, False
        keep = orch.keep_global_versions
        while keep and budget and self.versions_from[fragment] <= version - keep:
            deleted += self.store.prune_version(
                fragment, self.versions_from[fragment],
                f"keep_global_versions={keep}: version {version} committed")
            self.versions_from[fragment] += 1
            budget, moved = budget - 1, True
        keep = orch.keep_contribution_rounds
        while keep and budget and self.rounds_from <= round_index - keep:
            try:
                deleted += self.store.prune_round(
                    self.rounds_from, f"keep_contribution_rounds={keep}: round {round_index} "
                                      "merged")
            except Conflict:
                break   # not decided (yet): its contributions may still be merged
            self.rounds_from += 1
            budget, moved = budget - 1, True
        if moved:
            self.store.put_retention({"versions_from": self.versions_from,
                                      "rounds_from": self.rounds_from})
        if self.archiver is not None:
            deleted += self.archiver.step(self.rounds_from, ARCHIVE_STEPS_PER_MERGE)
        if self.version_archivers is not None:
            deleted += self.version_archivers[fragment].step(self.versions_from[fragment],
                                                             ARCHIVE_STEPS_PER_MERGE)
        return deleted


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
