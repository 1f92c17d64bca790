"""A partition of several rounds as the syncer service's mirror records it: one digest per
asset, released once all its rounds are mirrored (a learner's, once they are closed to late
offers), every round and offer counted in it."""

from diloco_core.round_records import RoundDecision
from diloco_core.stored_merge import StoredMerge
from pipelines.offer_summary import OfferSummary
from pipelines.partition_digest import hold_eval, hold_merge, hold_offer, release
from pipelines.partition_keys import partition_key
from resources.store.summary_records import RoundEval

EXP = "e1"
PART = partition_key(EXP, 0, 4)          # rounds 0-3


def _merge(held: dict, r: int, members=("learner-0", "learner-1"), merged=True) -> None:
    record = StoredMerge(round=r, fragment=r % 2, merged=merged, reason=f"round {r}",
                         members=members, weights=(0.5,) * len(members), bytes_in=100,
                         finite=True, merge_seconds=0.1 * (r + 1), published_at=10.0 + r)
    decision = RoundDecision(round=r, fragment=r % 2, members=members, reason="quorum",
                             decided_at=9.5 + r, late=("learner-2",) if r == 2 else ())
    hold_merge(held, PART, r, record, decision, version=r // 2 + 1)


def _offer(held: dict, r: int, learner: str, late=False) -> None:
    hold_offer(held, PART, OfferSummary(r, learner, late, fragment=r % 2, tokens=1000,
                                        steps=4, nbytes=64, staleness=r % 3,
                                        train_loss=3.0 - r / 10))


def _by_asset(events) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in events:
        out.setdefault(e.asset_key.path[-1], []).append(e)
    return out


def test_a_partition_is_released_once_its_rounds_are_mirrored_with_every_round_in_it():
    held: dict = {}
    for r in range(4):
        _merge(held, r, merged=r != 1)
        for learner in ("learner-0", "learner-1"):
            _offer(held, r, learner)
        if r in (1, 3):
            hold_eval(held, PART, r, RoundEval(loss=2.0 - r / 10, bits_per_byte=3.0,
                                               batches=2, by="syncer"))
        if r < 3:
            assert release(held, r, EXP) == []          # rounds still to come
    events = _by_asset(release(held, 3, EXP))
    assert held == {}
    (params,) = events["global_params"]
    meta = {k: v.value for k, v in params.metadata.items()}
    assert (meta["rounds"], meta["rounds_merged"], meta["round"], meta["first_round"]) == (
        4, 3, 3, 0)
    assert meta["versions"] == {"0": 2, "1": 2} and meta["late"] == 1
    assert meta["merge_seconds_max"] == 0.4 and meta["last_decision_reason"] == "round 3"
    assert sorted(e.partition.keys_by_dimension["learner"] for e in events["learner_update"]) \
        == ["e1/learner-0", "e1/learner-1"]
    for update in events["learner_update"]:
        figures = {k: v.value for k, v in update.metadata.items()}
        assert (figures["offers"], figures["tokens"], figures["steps"]) == (4, 4000, 16)
        assert figures["staleness_max"] == 2 and figures["train/loss"] == 2.7
    (evaluation,) = events["heldout_eval"]
    assert evaluation.metadata["round"].value == 3
    assert evaluation.metadata["evals_in_partition"].value == 2


def test_a_learners_digest_waits_for_its_partitions_late_offers():
    # A round takes late offers for LATE_WINDOW rounds after its decision: the partition's
    # merges are recorded once mirrored, each learner's offers once the rounds are closed to
    # offers, so one digest per learner holds every offer it reported, late ones too.
    held: dict = {}
    for r in range(4):
        _merge(held, r)
        _offer(held, r, "learner-0")
    first = _by_asset(release(held, 3, EXP, offers_upto=1))
    assert set(first) == {"global_params"}
    _offer(held, 3, "learner-1", late=True)            # within the late window
    assert release(held, 3, EXP, offers_upto=2) == []
    updates = _by_asset(release(held, 3, EXP, offers_upto=3))["learner_update"]
    figures = {e.partition.keys_by_dimension["learner"]: e.metadata for e in updates}
    assert figures["e1/learner-0"]["offers"].value == 4
    assert (figures["e1/learner-1"]["offers"].value, figures["e1/learner-1"]["late"].value) \
        == (1, 1)
    assert held == {} and release(held, None, EXP) == []    # nothing held twice


def test_the_end_of_the_run_releases_a_partition_whose_rounds_never_came():
    held: dict = {}
    _merge(held, 0)                                     # the run ended after round 0
    assert release(held, 0, EXP) == []
    events = _by_asset(release(held, None, EXP))
    assert events["global_params"][0].metadata["rounds"].value == 1


def test_a_partitions_held_digest_does_not_grow_with_its_rounds():
    import json

    sizes = []
    for rounds in (32, 1000):
        held: dict = {}
        for r in range(rounds):
            hold_merge(held, partition_key(EXP, 0, 1024), r,
                       StoredMerge(round=r, fragment=r % 4, merged=True, reason="quorum",
                                   members=("learner-0",), weights=(1.0,), finite=True,
                                   merge_seconds=0.1, published_at=10.0 + r),
                       RoundDecision(round=r, fragment=r % 4, members=("learner-0",),
                                     reason="quorum", decided_at=9.5 + r), r // 4 + 1)
        sizes.append(len(json.dumps(held)))
    assert sizes[1] < 1.2 * sizes[0]          # a few digits longer, not a list per round
