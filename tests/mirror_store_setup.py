"""A store holding many decided rounds and the versions that merged them, without a syncer:
what the quorum sensor's mirror reads (tests/test_round_mirror.py,
benchmarks/mirror_catch_up.py)."""

import numpy as np

from diloco_core.round_records import RoundOpen
from resources.store.artifact_store import ArtifactStore


def decide_rounds(store: ArtifactStore, upto: int) -> None:
    """Rounds 0..upto decided (fragment r % 2, one member), round upto + 1 open."""
    for r in range(upto + 2):
        if store.get_round_open(r) is None:
            store.open_round(r, RoundOpen(round=r, fragment=r % 2, opened_at=float(r)))
    for r in range(upto + 1):
        if store.get_decision(r) is None:
            store.put_decision(r, {"round": r, "fragment": r % 2, "members": ["learner-0"],
                                   "reason": "quorum", "decided_at": float(r)})


def commit_rounds(store: ArtifactStore, rounds: int, not_merged=(), skipped=()) -> dict:
    """Rounds 0..rounds-1 decided over two fragments, each merged into the next version of its
    fragment by the syncer, except those recorded as not merged and those skipped (neither
    committed nor recorded: a later round of the fragment committed past them). Returns the
    expected fate of every round: ("merged", version), ("not_merged", None) or ("skipped",
    None)."""
    for fragment in (0, 1):
        store.commit_global(fragment, 0, {"w": np.zeros(2, np.float32)}, [],
                            {"initial": True, "fragment": fragment})
    versions, expected = {0: 0, 1: 0}, {}
    decide_rounds(store, rounds - 1)
    for r in range(rounds):
        fragment = r % 2
        if r in not_merged:
            store.put_round_not_merged(r, {"round": r, "fragment": fragment,
                                           "reason": "refused", "merged_by": "syncer"})
            expected[r] = ("not_merged", None)
        elif r in skipped:
            expected[r] = ("skipped", None)
        else:
            versions[fragment] += 1
            store.commit_global(fragment, versions[fragment], {"w": np.zeros(2, np.float32)},
                                [], {"round": r, "fragment": fragment, "merged": True,
                                     "members": ["learner-0"], "merged_by": "syncer"})
            expected[r] = ("merged", versions[fragment])
    return expected
