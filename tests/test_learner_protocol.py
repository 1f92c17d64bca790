"""The learner's side of the round protocol (`diloco_core.learner_protocol.OfferBook`)."""

from diloco_core.config_loading import config_from_mapping, overrides_to_mapping
from diloco_core.learner_protocol import DECLINED_KEPT, OfferBook

PATIENCE = 300.0


def _offered_fragment_0(version: int = 3) -> OfferBook:
    """An offer of fragment 0 to round 4, made holding version `version`, at step 10."""
    return OfferBook().offered(4, 0, version, step=10, now=100.0)


def test_an_offer_is_pending_until_a_newer_version_of_its_fragment_arrives():
    book = _offered_fragment_0()
    assert book.settle([3, 0], 101.0, PATIENCE).choice(8, 0, False, 5, False) == "wait"
    assert book.settle([3, 0], 101.0, PATIENCE).choice(5, 1, False, 5, False) == "offer"
    answered = book.received_merge(0, 4, 4, "merged").settle([4, 0], 101.0, PATIENCE)
    assert not answered.in_flight(0) and answered.choice(8, 0, False, 5, False) == "offer"


def test_an_earlier_rounds_merge_does_not_answer_the_offer():
    """Fate "pending": the version that arrived merged round 0, not round 4 where the offer
    went. Answering it there let a second offer carry the first one's tokens again."""
    book = _offered_fragment_0().received_merge(0, 4, 0, "pending")
    settled = book.settle([4, 0], 101.0, PATIENCE)
    assert settled.in_flight(0) and settled.choice(8, 0, False, 5, False) == "wait"
    # ... until the merge that took it (or a later one) comes.
    later = settled.received_merge(0, 5, 4, "merged").settle([5, 0], 102.0, PATIENCE)
    assert not later.in_flight(0)


def test_a_merge_of_its_round_or_later_answers_an_offer_that_moved_no_version():
    """An offer that reached its round after the decision: that round's merge came first, and
    the version it holds already is that merge. Nothing newer will come for it."""
    book = _offered_fragment_0(version=4)
    book = book.received_merge(0, 4, 4, "not_merged")
    assert not book.settle([4, 0], 101.0, PATIENCE).in_flight(0)


def test_an_offer_no_merge_answers_is_given_up_after_the_patience():
    book = _offered_fragment_0()
    assert book.settle([3, 0], 100.0 + PATIENCE, PATIENCE).in_flight(0)
    assert not book.settle([3, 0], 100.1 + PATIENCE, PATIENCE).in_flight(0)


def test_pacing_counts_steps_past_a_pending_offer_until_its_own_merge_comes_back():
    cfg = config_from_mapping(overrides_to_mapping([
        "sync.block_on_overlap=true", "sync.sync_period=16", "sync.num_fragments=4",
        "sync.overlap_steps=2"]))
    book = _offered_fragment_0().saw_round(4, 1000)
    assert not book.must_wait(11, 1100, 100, cfg)
    assert book.must_wait(12, 1200, 100, cfg)                 # tau = 2 steps past the offer
    # An earlier round's merge does not release it (it did, before the book: any newer
    # version answered the pacing tracker).
    earlier = book.received_merge(0, 4, 0, "pending").settle([4, 0, 0, 0], 101.0, PATIENCE)
    assert earlier.must_wait(12, 1200, 100, cfg)
    own = earlier.received_merge(0, 5, 4, "merged").settle([5, 0, 0, 0], 101.0, PATIENCE)
    assert not own.must_wait(12, 1200, 100, cfg)


def test_a_round_is_answered_once_and_declines_are_kept_newest_first():
    book = OfferBook()
    for r in range(12):
        book = book.declined_round(r)
    assert book.declined == tuple(range(12 - DECLINED_KEPT, 12)) and book.answered == 11
    assert book.choice(11, 3, True, 0, True) == "answered"


def test_a_leaving_learner_has_nothing_left_once_its_latest_offer_followed_its_last_step():
    book = _offered_fragment_0()
    assert book.nothing_left_to_offer(0, steps_on_fragment=3, step=10)
    assert not book.nothing_left_to_offer(0, steps_on_fragment=3, step=11)
    assert book.nothing_left_to_offer(1, steps_on_fragment=0, step=11)
