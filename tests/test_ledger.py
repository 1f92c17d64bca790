"""The token ledger: every processed token is merged or lost for a named reason, exactly.

Tokens are counted as fragment-tokens (tokens x P): a token trains every fragment, and each
fragment reaches the global model on its own.
"""

import json
import random

import pytest

from diloco_core.ledger import FATES, AttemptLedger, build_ledger
from diloco_core.stored_merge import StoredMerge

P = 2


def _identity_holds(book: AttemptLedger, num_fragments: int) -> bool:
    claimed = sum(c[2] for c in book.claims) - sum(c[2] for c in book.returned)
    return (book.processed * num_fragments
            == claimed + sum(book.superseded) + sum(book.unclaimed))


# --- AttemptLedger: the learner side ------------------------------------------------------------

def test_a_new_attempt_has_nothing_to_account_for():
    book = AttemptLedger.start(3)
    assert (book.processed, book.unclaimed, book.superseded, book.claims) == (
        0, (0, 0, 0), (0, 0, 0), ())


def test_processed_tokens_are_unclaimed_on_every_fragment():
    book = AttemptLedger.start(P).after_step(5).after_step(3)
    assert book.processed == 8
    assert book.unclaimed == (8, 8)
    assert _identity_holds(book, P)


def test_an_offer_claims_the_unclaimed_tokens_of_its_fragment_only():
    book = AttemptLedger.start(P).after_step(10)
    book, claim = book.offered(1, round_index=4)
    assert claim == 10
    assert book.unclaimed == (10, 0)
    assert book.claims == ((4, 1, 10),)
    # A later offer of the same fragment before a receipt claims only what is new.
    book, claim = book.after_step(2).offered(1, round_index=5)
    assert claim == 2
    assert book.claims == ((4, 1, 10), (5, 1, 2))
    assert book.unclaimed == (12, 0)
    assert _identity_holds(book, P)


def test_a_received_fragment_supersedes_what_was_unclaimed_on_it():
    book = AttemptLedger.start(P).after_step(10)
    book, _ = book.offered(0, 0)
    book = book.after_step(3).received(0)
    # Fragment 0: 3 tokens computed on a replaced fragment. Fragment 1: untouched.
    assert book.superseded == (3, 0)
    assert book.unclaimed == (0, 13)
    # Receiving again with nothing unclaimed changes nothing.
    assert book.received(0) == book
    assert _identity_holds(book, P)


def test_under_rebase_a_received_fragment_keeps_what_is_unclaimed_for_the_next_offer():
    book = AttemptLedger.start(P).after_step(10)
    book, _ = book.offered(0, 0)
    book = book.after_step(3).received(0, keeps_local=True)
    assert book.superseded == (0, 0)
    assert book.unclaimed == (3, 13)
    book, claim = book.offered(0, 1)
    assert claim == 3
    assert _identity_holds(book, P)


def test_ledger_operations_do_not_mutate():
    start = AttemptLedger.start(P)
    stepped = start.after_step(4)
    stepped.offered(0, 0)
    stepped.received(1)
    assert start == AttemptLedger.start(P)
    assert stepped == AttemptLedger(4, (4, 4), (0, 0))


def _random_attempt(rng: random.Random, num_fragments: int, ops: int) -> AttemptLedger:
    book = AttemptLedger.start(num_fragments)
    round_index = 0
    for _ in range(ops):
        op = rng.random()
        if op < 0.6:
            book = book.after_step(rng.randrange(0, 50))
        elif op < 0.85:
            book, claim = book.offered(rng.randrange(num_fragments), round_index)
            assert claim >= 0
            round_index += 1
        else:
            book = book.received(rng.randrange(num_fragments))
    return book


@pytest.mark.parametrize("seed", range(5))
def test_identity_holds_after_any_sequence(seed):
    rng = random.Random(seed)
    num_fragments = rng.randrange(1, 6)
    book = AttemptLedger.start(num_fragments)
    for _ in range(300):
        op = rng.random()
        if op < 0.6:
            book = book.after_step(rng.randrange(0, 50))
        elif op < 0.85:
            book, _ = book.offered(rng.randrange(num_fragments), rng.randrange(100))
        else:
            book = book.received(rng.randrange(num_fragments))
        # processed x P = claimed + superseded + unclaimed, after every single operation.
        assert _identity_holds(book, num_fragments)
    assert book.processed > 0 and book.claims  # the sequence exercised something


def test_record_round_trips_through_json():
    book = _random_attempt(random.Random(11), 3, 200)
    record = json.loads(json.dumps(book.to_record()))
    assert record["processed"] == book.processed
    # There is no from_record: the record's fields rebuild the same ledger.
    rebuilt = AttemptLedger(record["processed"], tuple(record["unclaimed"]),
                            tuple(record["superseded"]),
                            tuple(tuple(c) for c in record["claims"]),
                            tuple(tuple(c) for c in record["returned"]))
    assert rebuilt == book


def test_a_random_attempt_balances_in_build_ledger():
    # Every claim offered and merged, nothing else: merged + superseded + unclaimed is all.
    book = _random_attempt(random.Random(5), 4, 300)
    record = {"learner": "a", "attempt": 0, "status": "done", "final": True,
              "ledger": json.loads(json.dumps(book.to_record()))}
    offers = {(r, "a"): {"attempt": 0, "claim": c} for r, _, c in book.claims}
    fates = dict.fromkeys(offers, "merged")
    ledger = build_ledger(4, [record], offers, fates)
    assert ledger.balanced and not ledger.problems
    assert ledger.processed == book.processed * 4
    assert ledger.fates["merged"] == sum(c[2] for c in book.claims)
    assert ledger.fates["superseded_on_receipt"] == sum(book.superseded)
    assert ledger.fates["stopped_before_offer"] == sum(book.unclaimed)


# --- build_ledger: the syncer side --------------------------------------------------------------

def _a0() -> AttemptLedger:
    """Learner a's first process: one offer of each fate, then it dies."""
    b = AttemptLedger.start(P).after_step(10)
    b, _ = b.offered(0, 0)                    # 10, merged
    b, _ = b.after_step(5).offered(1, 1)      # 15, late
    b = b.received(0)                         # 5 superseded on fragment 0
    b, _ = b.after_step(4).offered(0, 2)      # 4, rejected
    b, _ = b.after_step(3).offered(1, 3)      # 7, round_not_merged
    b, _ = b.after_step(2).offered(0, 4)      # 5, undecided (no fate recorded)
    b, _ = b.after_step(1).offered(1, 5)      # 3, never reached the store
    return b.after_step(2)                    # unclaimed (3, 2): died before offering them


def _a1() -> AttemptLedger:
    """Learner a relaunched: offers round 4 again, which the store already has from a/0."""
    b = AttemptLedger.start(P).after_step(6)
    b, _ = b.offered(0, 4)                    # 6, duplicate_offer
    b = b.received(1)                         # 6 superseded on fragment 1
    return b.after_step(1)                    # unclaimed (1, 1): stopped before offering them


def _b0() -> AttemptLedger:
    """Learner b: two merged offers, still running (a heartbeat record, not final)."""
    b = AttemptLedger.start(P).after_step(8)
    b, _ = b.offered(0, 0)                    # 8, merged
    b, _ = b.after_step(2).offered(1, 1)      # 10, merged
    b = b.received(0)                         # 2 superseded on fragment 0
    return b.after_step(1)                    # unclaimed (1, 1)


def _c0() -> AttemptLedger:
    """Learner c: one merged offer, then its capacity was reclaimed (it left)."""
    b = AttemptLedger.start(P).after_step(2)
    b, _ = b.offered(0, 5)                    # 2, merged
    return b.after_step(1)                    # unclaimed (1, 3): left before offering them


def _scenario(b_final: bool = False):
    attempts = [
        {"learner": "a", "attempt": 0, "status": "failed", "final": True,
         "ledger": _a0().to_record()},
        {"learner": "a", "attempt": 1, "status": "done", "final": True,
         "ledger": _a1().to_record()},
        {"learner": "b", "attempt": 0, "status": "running", "final": b_final,
         "ledger": _b0().to_record()},
        {"learner": "c", "attempt": 0, "status": "left", "final": True,
         "ledger": _c0().to_record()},
    ]
    offers = {(0, "a"): {"attempt": 0, "claim": 10}, (1, "a"): {"attempt": 0, "claim": 15},
              (2, "a"): {"attempt": 0, "claim": 4}, (3, "a"): {"attempt": 0, "claim": 7},
              (4, "a"): {"attempt": 0, "claim": 5},
              (0, "b"): {"attempt": 0, "claim": 8}, (1, "b"): {"attempt": 0, "claim": 10},
              (5, "c"): {"attempt": 0, "claim": 2}}
    fates = {(0, "a"): "merged", (1, "a"): "late", (2, "a"): "rejected",
             (3, "a"): "round_not_merged", (0, "b"): "merged", (1, "b"): "merged",
             (5, "c"): "merged"}
    return attempts, offers, fates


# Fragment-tokens per fate in the scenario above (the sum is 96 = (27 + 7 + 11 + 3) x P).
EXPECTED = {"merged": 10 + 8 + 10 + 2, "late": 15, "rejected": 4, "round_not_merged": 7,
            "undecided": 5, "offer_not_stored": 3, "duplicate_offer": 6,
            "superseded_on_receipt": 5 + 6 + 2, "died_before_offer": 5 + 2,
            "stopped_before_offer": 2, "left_before_offer": 4}


def test_the_scenario_records_are_self_consistent():
    for book in (_a0(), _a1(), _b0(), _c0()):
        assert _identity_holds(book, P)


def test_every_fate_gets_exactly_its_tokens():
    ledger = build_ledger(P, *_scenario())
    assert set(EXPECTED) == set(FATES)  # the scenario covers every fate
    assert ledger.fates == EXPECTED
    assert ledger.processed == 96
    assert ledger.problems == []
    assert ledger.balanced


def test_fates_per_learner():
    ledger = build_ledger(P, *_scenario())
    a, b = ledger.by_learner["a"], ledger.by_learner["b"]
    assert a["processed"] == (27 + 7) * P
    assert b["processed"] == 11 * P
    assert (a["merged"], a["duplicate_offer"], a["stopped_before_offer"]) == (10, 6, 2)
    assert (a["died_before_offer"], a["superseded_on_receipt"]) == (5, 11)
    assert (b["merged"], b["superseded_on_receipt"], b["died_before_offer"]) == (18, 2, 2)
    assert b["late"] == b["duplicate_offer"] == 0
    c = ledger.by_learner["c"]
    assert (c["processed"], c["merged"], c["left_before_offer"]) == (3 * P, 2, 4)
    # Per learner, too, everything processed is accounted for.
    for row in (a, b, c):
        assert sum(v for k, v in row.items() if k != "processed") == row["processed"]


def test_summary_reports_tokens_not_fragment_tokens():
    summary = build_ledger(P, *_scenario()).summary()
    assert summary["tokens_processed"] == 48
    assert summary["tokens"] == {k: v / P for k, v in EXPECTED.items()}
    assert summary["merged_fraction"] == pytest.approx(30 / 96)
    assert summary["by_learner"]["b"]["merged"] == 9
    assert list(summary["by_learner"]) == ["a", "b", "c"]
    assert summary["balanced"] is True and summary["problems"] == []
    assert summary["reasons"] == FATES


def test_a_heartbeat_record_makes_the_ledger_inexact():
    inexact = build_ledger(P, *_scenario(b_final=False)).summary()
    assert inexact["exact"] is False
    assert inexact["inexact_attempts"] == ["b/0"]
    exact = build_ledger(P, *_scenario(b_final=True)).summary()
    assert exact["exact"] is True and exact["inexact_attempts"] == []
    # Inexact is not unbalanced: the record is a heartbeat behind, but consistent.
    assert inexact["balanced"] is True


@pytest.mark.parametrize("status, fate", [("done", "stopped_before_offer"),
                                          ("superseded", "stopped_before_offer"),
                                          ("left", "left_before_offer"),
                                          ("failed", "died_before_offer"),
                                          ("running", "died_before_offer"),
                                          (None, "died_before_offer")])
def test_unclaimed_tokens_at_the_end_of_an_attempt(status, fate):
    record = {"learner": "a", "attempt": 0, "status": status, "final": True,
              "ledger": AttemptLedger.start(P).after_step(3).to_record()}
    ledger = build_ledger(P, [record], {}, {})
    assert ledger.fates[fate] == 6
    assert sum(ledger.fates.values()) == 6 and ledger.balanced


def test_an_inconsistent_record_is_a_problem():
    attempts, offers, fates = _scenario()
    attempts[1]["ledger"]["processed"] += 1   # 2 fragment-tokens nobody accounts for
    ledger = build_ledger(P, attempts, offers, fates)
    assert ledger.problems == ["a attempt 1: processed 16 fragment-tokens but accounts for 14"]
    assert not ledger.balanced
    assert ledger.summary()["balanced"] is False


def test_an_inconsistent_record_is_a_problem_even_if_the_totals_agree():
    # a/1 accounts for 2 fragment-tokens too few and b/0 for 2 too many: the run's totals
    # match, but each attempt's own accounting does not, and that must not cancel out.
    attempts, offers, fates = _scenario()
    attempts[1]["ledger"]["unclaimed"] = [0, 0]
    attempts[2]["ledger"]["unclaimed"] = [2, 2]
    ledger = build_ledger(P, attempts, offers, fates)
    assert sum(ledger.fates.values()) == ledger.processed
    assert len(ledger.problems) == 2
    assert ledger.problems[0].startswith("a attempt 1:")
    assert ledger.problems[1].startswith("b attempt 0:")
    assert not ledger.balanced


def test_a_stored_offer_in_no_record_is_a_problem():
    attempts, offers, fates = _scenario()
    offers[(6, "b")] = {"attempt": 0, "claim": 3}
    ledger = build_ledger(P, attempts, offers, fates)
    assert ledger.problems == ["b's offer to round 6 (attempt 0) is in no learner's record"]
    # The token totals still add up, yet the ledger is not balanced: a problem is a problem.
    assert sum(ledger.fates.values()) == ledger.processed
    assert not ledger.balanced


def test_an_offer_from_before_the_ledger_is_not_a_problem():
    # Offers without a claim predate the ledger; they cannot be matched and are not counted.
    attempts, offers, fates = _scenario()
    offers[(6, "b")] = {"attempt": 0}
    ledger = build_ledger(P, attempts, offers, fates)
    assert ledger.problems == [] and ledger.balanced


def test_a_claim_that_disagrees_with_the_store_is_a_problem():
    attempts, offers, fates = _scenario()
    offers[(0, "b")] = {"attempt": 0, "claim": 9}
    ledger = build_ledger(P, attempts, offers, fates)
    assert ledger.problems == ["b attempt 0: round 0 offer claims 9 in the store, 8 in the "
                               "learner's record"]
    assert not ledger.balanced
    # The learner's own record decides the amount.
    assert ledger.fates["merged"] == EXPECTED["merged"]


def test_a_duplicate_offer_does_not_steal_the_stored_offers_fate():
    # a/1's round-4 claim is refused as a duplicate; a/0's stored round-4 offer keeps its fate.
    attempts, offers, fates = _scenario()
    fates[(4, "a")] = "merged"
    ledger = build_ledger(P, attempts, offers, fates)
    assert ledger.fates["merged"] == EXPECTED["merged"] + 5
    assert ledger.fates["undecided"] == 0
    assert ledger.fates["duplicate_offer"] == 6
    assert ledger.balanced


def test_an_empty_run():
    ledger = build_ledger(P, [], {}, {})
    assert ledger.processed == 0 and ledger.balanced
    assert ledger.summary()["merged_fraction"] is None


# --- the store side: a learner writes its offers' `extra` and its records -----------------------

def _store_run(tmp_path, extra, base_version=0):
    """Round 0 with two offers: learner-0's honest one, and learner-1's, whose manifest carries
    `extra` as given (the learner writes it: free-form JSON)."""
    from pipelines.commands.cli import load_config
    from resources.store import layout
    from resources.store.artifact_store import ArtifactStore
    from resources.store.blobs import LocalBlobStore

    cfg = load_config(None, ["name=exp", "learners.num_learners=2", "sync.num_fragments=1",
                             "sync.min_quorum=1"])
    store = ArtifactStore(LocalBlobStore(tmp_path / "store"), "exp")
    store.open_round(0, {"fragment": 0, "opened_at": 1.0})
    for name, claim, offer_extra in (("learner-0", 8, {"attempt": 0, "claim": 8,
                                                         "train_loss": 2.5}),
                                     ("learner-1", 4, extra)):
        store.put_attempt_record(name, 0, {
            "learner": name, "attempt": 0, "status": "done", "final": True,
            "ledger": {"processed": claim, "unclaimed": [0], "superseded": [0],
                       "claims": [[0, 0, claim]]}})
        key = f"{layout.contribution_dir('exp', 0, name)}/{layout.MANIFEST}"
        manifest = {  # a sound manifest but for what the test puts in `extra`
            "format": 1, "kind": "contribution", "learner": name, "round": 0, "fragment": 0,
            "base_version": base_version, "tokens": claim, "steps": 1, "learner_step": 1,
            "clock": 0.0, "extra": offer_extra,
            "tensors": [{"name": "w", "shape": [1], "encoding": "fp32", "block_size": 1,
                         "scales": False}],
            "objects": {"delta": {"name": "delta.npz", "size": 0, "sha256": "0" * 64}}}
        store.blobs.write(key, json.dumps(manifest).encode())
    return store, cfg


@pytest.mark.parametrize("extra, reason", [
    (["attempt", 0], "extra: must be an object, got list"),
    ("claim 4", "extra: must be an object, got str"),
    (7, "extra: must be an object, got int"),
    ({"attempt": "0", "claim": 4}, "extra.attempt must be an integer in [0, 99999], got 0"),
    ({"attempt": True, "claim": 4}, "extra.attempt must be an integer in [0, 99999]"),
    ({"attempt": 10**6, "claim": 4}, "extra.attempt must be an integer in [0, 99999]"),
    ({"attempt": 0, "claim": -4}, "extra.claim must be an integer in [0, "),
    ({"attempt": 0, "claim": 4.0}, "extra.claim must be an integer in [0, "),
    ({"attempt": 0, "claim": 10**400}, "extra.claim must be an integer in [0, "),
])
def test_a_malformed_offer_extra_is_refused_with_a_reason_and_the_ledger_still_comes(
        tmp_path, extra, reason):
    """An `extra` that was a list or a string made `run_ledger` raise, and so no run summary
    was written; one whose attempt was a string or a bool passed for a number."""
    from pipelines.token_ledger import run_ledger

    store, cfg = _store_run(tmp_path, extra)
    ledger, _ = run_ledger(store, cfg)
    key = "experiments/exp/rounds/r00000000/contributions/learner-1/manifest.json"
    assert len(ledger.refused_records) == 1, ledger.refused_records
    assert ledger.refused_records[0].startswith(f"{key}: {reason}"), ledger.refused_records
    # Its offer is not counted as stored; the honest learner's is; everything balances.
    assert ledger.by_learner["learner-1"]["offer_not_stored"] == 4
    assert ledger.by_learner["learner-0"]["undecided"] == 8
    assert ledger.balanced, ledger.problems


def test_build_ledger_guards_the_stored_offers_fields_too():
    record = {"learner": "a", "attempt": 0, "status": "done", "final": True,
              "ledger": {"processed": 3, "unclaimed": [0, 0], "superseded": [0, 0],
                         "claims": [[0, 0, 2], [1, 1, 4]]}}
    ledger = build_ledger(P, [record], {(0, "a"): {"attempt": "zero", "claim": 2},
                                        (1, "a"): ["attempt", 0]}, {})
    assert ledger.fates["offer_not_stored"] == 6
    assert ledger.problems == [
        "a's offer to round 0: attempt must be an integer in [0, 99999], got zero",
        "a's offer to round 1: the stored offer must be an object, got list"]


@pytest.mark.parametrize("extra", [["train_loss", 1.0], "2.0", {"train_loss": "low"},
                                   {"train_loss": float("nan")}, {"train_loss": True}])
def test_the_round_metadata_plots_only_sound_figures_from_a_learners_manifest(tmp_path, extra):
    from pipelines.round_metadata import _per_learner_series

    store, _ = _store_run(tmp_path, extra, base_version=3)
    series = _per_learner_series(store, ["learner-0", "learner-1"],
                                 StoredMerge(members=("learner-0", "learner-1"),
                                             weights=(0.5, 0.5)),
                                 0, 4)
    # learner-1's train loss is never plotted; an `extra` that is no object makes its whole
    # manifest unsound (refused by the store), so nothing of it is plotted but its weight.
    sound = {"staleness/learner-1": 1} if isinstance(extra, dict) else {}
    assert series == {"weight/learner-0": 0.5, "weight/learner-1": 0.5,
                      "train_loss/learner-0": 2.5, "staleness/learner-0": 1, **sound}


def test_the_resilience_report_skips_malformed_fired_and_attempt_fields(tmp_path):
    from diloco_core.ledger import Ledger
    from pipelines.resilience import resilience_report
    from resources.store import layout
    from resources.store.summary_records import FiredFault

    store, cfg = _store_run(tmp_path, {"attempt": 0, "claim": 4})
    # A chaos run's learners may record fired faults: here, ones a hostile learner forged.
    store.blobs.write(layout.fired_fault("exp", "good") + ".json",
                      b'{"id": "good", "kind": "learner_kill", "learner": "learner-0", '
                      b'"step": 3, "time": 5.0, "junk": NaN}')
    store.mark_fault_fired("bad-time", {"id": "bad-time", "kind": "learner_kill",
                                        "learner": "learner-0", "time": "soon"})
    store.mark_fault_fired("bad-kind", {"id": "bad-kind", "kind": ["learner_kill"],
                                        "time": 6.0})
    store.mark_fault_fired("stranger", {"id": "stranger", "kind": "learner_hang",
                                        "learner": "nobody", "time": 6.0})
    store.blobs.write(layout.attempt("exp", "learner-0", 1), json.dumps({
        "learner": "learner-0", "attempt": 1, "status": "done", "final": True,
        "started_at": "later", "compute_seconds": float("inf"),
        "ledger": {"processed": 0, "unclaimed": [0], "superseded": [0], "claims": []}}).encode())
    report = resilience_report(store, cfg, [], Ledger(1))
    assert [f.id for f in report.faults] == ["good"]
    assert report.faults[0] == FiredFault(id="good", kind="learner_kill", learner="learner-0",
                                          step=3, time=5.0)
    assert report.rejoins[0].relaunched_at is None
    json.dumps(report.to_json(), allow_nan=False)     # the summary is strict JSON


def test_a_returned_claim_is_counted_once_by_the_offer_that_carries_it_next():
    # Under rebase, round 3's offer was late: the learner kept its progress and returned the
    # claim; round 5's offer carries those tokens too and is merged. Nothing counts twice.
    book = AttemptLedger.start(P).after_step(10)
    book, first = book.offered(0, round_index=3)
    book = book.after_step(4).returned_claim(0, 3)
    assert first == 10 and book.unclaimed == (14, 14)
    assert book.returned_claim(0, 3) == book          # once
    assert _identity_holds(book, P)
    book, second = book.offered(0, round_index=5)
    assert second == first + 4
    record = {"learner": "a", "attempt": 0, "status": "done", "final": True,
              "ledger": json.loads(json.dumps(book.to_record()))}
    offers = {(3, "a"): {"attempt": 0, "claim": first}, (5, "a"): {"attempt": 0, "claim": second}}
    ledger = build_ledger(P, [record], offers, {(3, "a"): "late", (5, "a"): "merged"})
    assert ledger.balanced and not ledger.problems
    assert (ledger.fates["late"], ledger.fates["merged"]) == (0, second)
    # A record that returns more than it claimed is named.
    record["ledger"]["returned"] = [[3, 0, first + 1]]
    assert build_ledger(P, [record], offers, {(3, "a"): "late", (5, "a"): "merged"}).problems


class _Versions:
    """A fragment's version records as the store answers them (`current_version`,
    `version_meta`), counting the reads: version v committed round `rounds[v]` (None: version
    0, or a manual merge that committed no round)."""

    def __init__(self, rounds):
        self.rounds, self.reads = rounds, 0

    def current_version(self, fragment):
        return len(self.rounds) - 1

    def version_meta(self, fragment, version):
        self.reads += 1
        return StoredMerge(round=self.rounds[version])


def test_committed_rounds_finds_each_rounds_commit_reading_forward_from_a_bisection():
    """The archiver's question "which version committed round r" for rounds in order: the
    same answers as a scan of every version, the first in a few reads however far back the
    round is, then each version read once (the syncer's loop must not stall on a catch-up)."""
    from pipelines.token_ledger import CommittedRounds

    # Rounds of fragment 0 in a P = 4 run: every fourth, some not merged, two manual merges.
    rounds = [None] + [r for r in range(0, 40_000, 4) if r % 36 != 8]
    rounds[500:500] = [None, None]
    versions = _Versions(rounds)
    committed = {r: v for v, r in enumerate(rounds) if r is not None}
    for first in (0, 20_000, 39_996):
        finder = CommittedRounds(versions)
        versions.reads = 0
        asked = range(first, min(first + 400, 40_000))
        found = {r: finder.merge_of(0, r) for r in asked}
        assert {r: m.round for r, m in found.items() if m is not None} == {
            r: r for r in asked if r in committed}
        # ~log2(10,000) = 14 to start, then the ~100 versions of those 400 rounds, once each.
        assert versions.reads <= 2 * 14 + 2 + 400 // 4 + 1, (first, versions.reads)
