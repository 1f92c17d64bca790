"""What a relaunched learner inherits of its earlier attempts' offers
(`resources/learner/inherited_offers.py`), against a store's answers: the newest offer of each
fragment that the versions it starts from do not include yet, nothing the store refuses, and
the same book on every process of a multi-host learner."""

from types import SimpleNamespace

from learner_store_setup import collecting_logger

from resources.learner.inherited_offers import (
    as_ints,
    as_pending,
    offered_before,
    offers_in_flight,
)
from resources.store.artifact_store import RejectedArtifact


class Offers:
    """A store's answers to `contribution_manifest`: round -> (fragment, base) or an error."""

    def __init__(self, offers: dict):
        self.offers, self.asked = offers, []

    def contribution_manifest(self, round_index: int, learner: str):
        self.asked.append(round_index)
        found = self.offers.get(round_index)
        if isinstance(found, Exception):
            raise found
        return None if found is None else SimpleNamespace(fragment=found[0],
                                                          base_version=found[1])


def test_the_newest_offer_of_each_fragment_not_yet_merged_is_inherited():
    # P = 2: rounds 9 (fragment 1) and 8 (fragment 0) are the newest offers; round 7's offer
    # of fragment 1 is older than round 9's and does not count.
    store = Offers({9: (1, 4), 8: (0, 3), 7: (1, 3), 6: (0, 2)})
    assert offers_in_flight(store, "learner-0", 10, [3, 4]) == {0: (8, 3), 1: (9, 4)}
    # Only the last 2P rounds are read (older offers' rounds are decided and published).
    assert store.asked == [10, 9, 8, 7]
    # Starting from versions that include the merges of both: nothing is in flight.
    assert offers_in_flight(store, "learner-0", 10, [4, 5]) == {}


def test_an_offer_the_store_refuses_or_names_no_fragment_of_ours_is_not_inherited():
    logs: list = []
    log = collecting_logger("inherited", logs)
    store = Offers({5: RejectedArtifact("r5/manifest.json", "fragment: not an integer"), 4: (7, 0),
                    3: (1, 0)})
    assert offers_in_flight(store, "learner-0", 5, [0, 0], log) == {1: (3, 0)}
    assert any("round 5 is unreadable" in line for line in logs)
    assert offers_in_flight(store, "learner-0", None, [0, 0]) == {}


def test_the_book_is_broadcast_as_integers_and_read_back_the_same():
    found = {1: (9, 4)}
    flat = as_ints(found, 2)
    assert flat == [-1, -1, 9, 4]
    pending = as_pending(flat, step=120, since=50.0)
    assert list(pending) == [9]
    assert (pending[9].round, pending[9].fragment, pending[9].version,
            pending[9].step, pending[9].since) == (9, 1, 4, 120, 50.0)


def test_a_refused_manifest_counts_as_offered():
    store = Offers({3: RejectedArtifact("r3/manifest.json", "torn"), 2: (0, 0)})
    assert offered_before(store, "learner-0", 3) and offered_before(store, "learner-0", 2)
    assert not offered_before(store, "learner-0", 1)
