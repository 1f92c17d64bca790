"""What one syncer process has done, for its progress lines, its final record and the run
summary: merges and their latency, its evals, what retention pruned."""

from dataclasses import dataclass, field

from resources.store.summary_records import HeldoutEval


@dataclass
class SyncerProgress:
    merged: int = 0
    not_merged: int = 0
    decision_to_publish: list[float] = field(default_factory=list)   # seconds, per merge
    last_eval_round: int | None = None
    merges_since_eval: int = 0
    # The summary's evals, made with this process's warm eval program: version 0 of every
    # fragment (during the warm-up) and the last eval after a merge.
    initial_eval: HeldoutEval | None = None
    last_eval: HeldoutEval | None = None
    pruned_objects: int = 0
