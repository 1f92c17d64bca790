"""The token ledger: every token a learner processed is either merged or lost for a reason.

A token a learner trains on changes every fragment, and each fragment reaches the global model
separately, so the ledger counts fragment-tokens (tokens x P) and reports tokens as that / P.

Learner side (`AttemptLedger`, one per learner process): tokens processed since the learner last
offered or received a fragment are *unclaimed*; an offer *claims* them (the first offer that
carries a token decides its fate, later offers of the same fragment before a receipt only claim
what is new); when a merged fragment arrives, what is still unclaimed was computed on a fragment
that is now replaced, and is *superseded*. Under the "rebase" rule a learner that sees its offer
was not merged keeps that progress and *returns* the offer's claim to unclaimed, for its next
offer to carry. So, per attempt and exactly:
    processed x P = claimed - returned + superseded + unclaimed.
Syncer side (`build_ledger`): each claim takes the fate of its offer in the store: merged,
late, rejected (with the merge's reason), in a round that committed nothing, undecided when
the run ended, or never offered at all (the process died before its upload); unclaimed tokens
at the end of an attempt were lost because it died (or stopped, left, or was superseded by a
newer attempt of the same learner) before offering them.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from diloco_core.round_records import MAX_INT

# A learner process's attempt number, as its record's name holds it (a{n:05d}.json).
MAX_ATTEMPT = 99_999


def ledger_count(value: Any, high: int) -> bool:
    """Whether `value` is an integer in [0, high] (not a bool): every count or index the
    ledger reads from a record a learner wrote is checked with this where it is read."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high


# Where tokens end up; all but "merged" are losses, each with its reason.
FATES = {
    "merged": "in a committed merge",
    "late": "offered, but after its round was decided",
    "rejected": "offered, refused by the merge (reason recorded per round)",
    "round_not_merged": "offered and admitted, but the round committed nothing",
    "undecided": "offered to a round that was never decided before the run ended",
    "offer_not_stored": "the learner died before its offer reached the store",
    "died_before_offer": "processed by a learner process that died before offering them",
    "stopped_before_offer": "processed after the last offer of a learner that stopped",
    "left_before_offer": "processed after the last offer of a learner that left (its "
                         "capacity was reclaimed) before it could offer them",
    "superseded_on_receipt": "processed after the last offer, then the fragment was "
                             "replaced by a merged version",
    "duplicate_offer": "carried by an offer refused because the round already had one from "
                       "an earlier process of the same learner",
}


@dataclass(frozen=True)
class AttemptLedger:
    """One learner process's token accounting (fragment-tokens), updated as it trains."""

    processed: int
    unclaimed: tuple[int, ...]
    superseded: tuple[int, ...]
    claims: tuple[tuple[int, int, int], ...] = ()   # (round, fragment, fragment-tokens)
    returned: tuple[tuple[int, int, int], ...] = ()  # claims of offers no merge took, kept

    @classmethod
    def start(cls, num_fragments: int) -> "AttemptLedger":
        return cls(0, (0,) * num_fragments, (0,) * num_fragments)

    def after_step(self, tokens: int) -> "AttemptLedger":
        return replace(self, processed=self.processed + tokens,
                       unclaimed=tuple(u + tokens for u in self.unclaimed))

    def offered(self, fragment: int, round_index: int) -> tuple["AttemptLedger", int]:
        """Claim what is unclaimed on `fragment` for this offer; returns the claim."""
        claim = self.unclaimed[fragment]
        unclaimed = list(self.unclaimed)
        unclaimed[fragment] = 0
        return replace(self, unclaimed=tuple(unclaimed),
                       claims=self.claims + ((round_index, fragment, claim),)), claim

    def returned_claim(self, fragment: int, round_index: int) -> "AttemptLedger":
        """The offer to `round_index` was not merged and the learner kept its progress
        ("rebase"): its claim is unclaimed again (once), for the next offer to carry."""
        done = {(r, p) for r, p, _ in self.returned}
        for r, p, claim in self.claims:
            if (r, p) == (round_index, fragment) and (r, p) not in done:
                unclaimed = list(self.unclaimed)
                unclaimed[fragment] += claim
                return replace(self, unclaimed=tuple(unclaimed),
                               returned=self.returned + ((r, p, claim),))
        return self

    def received(self, fragment: int, keeps_local: bool = False) -> "AttemptLedger":
        """A merged fragment arrived. Overwrite and blend supersede what is unclaimed; the
        "rebase" rule (`keeps_local`) keeps it for the next offer to claim."""
        if keeps_local:
            return self
        unclaimed, superseded = list(self.unclaimed), list(self.superseded)
        superseded[fragment] += unclaimed[fragment]
        unclaimed[fragment] = 0
        return replace(self, unclaimed=tuple(unclaimed), superseded=tuple(superseded))

    def to_record(self) -> dict:
        return {"processed": self.processed, "unclaimed": list(self.unclaimed),
                "superseded": list(self.superseded),
                "claims": [list(c) for c in self.claims],
                "returned": [list(c) for c in self.returned]}


@dataclass
class Ledger:
    num_fragments: int
    processed: int = 0                                   # fragment-tokens
    fates: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FATES, 0))
    by_learner: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    inexact_attempts: list[str] = field(default_factory=list)
    # Attempt records and offers refused before accounting ("key: reason"): unreadable or
    # malformed, as a hostile or broken learner may write them (an offer's attempt or claim
    # among them). The rest is accounted without them.
    refused_records: list[str] = field(default_factory=list)

    def add(self, learner: str, fate: str, amount: int) -> None:
        self.fates[fate] += amount
        row = self.by_learner.setdefault(learner, dict.fromkeys(["processed", *FATES], 0))
        row[fate] += amount

    @property
    def balanced(self) -> bool:
        return not self.problems and sum(self.fates.values()) == self.processed

    def summary(self) -> dict:
        """Tokens (fragment-tokens / P) per fate, the goodput fraction and the checks."""
        P = self.num_fragments

        def tokens(x: int) -> float:
            return x / P

        return {"tokens_processed": tokens(self.processed),
                "tokens": {k: tokens(v) for k, v in self.fates.items()},
                "merged_fraction": (self.fates["merged"] / self.processed
                                    if self.processed else None),
                "by_learner": {n: {k: tokens(v) for k, v in row.items()}
                               for n, row in sorted(self.by_learner.items())},
                "balanced": self.balanced, "problems": list(self.problems),
                "exact": not self.inexact_attempts,
                "inexact_attempts": list(self.inexact_attempts),
                "refused_records": list(self.refused_records),
                "reasons": dict(FATES)}


def build_ledger(num_fragments: int, attempts: Iterable[Mapping[str, Any]],
                 offers: Mapping[tuple[int, str], Mapping[str, Any]],
                 fates: Mapping[tuple[int, str], str]) -> Ledger:
    """Assemble the ledger from the learners' attempt records and the store.

    attempts: each {"learner", "attempt", "status", "final", "ledger": AttemptLedger record};
      "final" says the record was written when the process ended (or right before an injected
      kill): otherwise it may be a heartbeat behind, and the attempt is reported as inexact.
    offers: (round, learner) -> the stored offer's {"attempt", "claim"} (`claim` absent for
      offers from before the ledger existed).
    fates: (round, learner) -> one of merged, late, rejected, round_not_merged, undecided.
    """
    ledger = Ledger(num_fragments)
    matched: set[tuple[int, str]] = set()
    for record in attempts:
        name, attempt = record["learner"], int(record["attempt"])
        book = record["ledger"]
        processed = int(book["processed"]) * num_fragments
        ledger.processed += processed
        row = ledger.by_learner.setdefault(name, dict.fromkeys(["processed", *FATES], 0))
        row["processed"] += processed
        claims = [tuple(c) for c in book["claims"]]
        returned: dict[tuple[int, int], int] = {}
        for r, p, amount in book.get("returned") or ():
            returned[(r, p)] = returned.get((r, p), 0) + amount
        own = (sum(c[2] for c in claims) - sum(returned.values()) + sum(book["superseded"])
               + sum(book["unclaimed"]))
        if own != processed:
            ledger.problems.append(f"{name} attempt {attempt}: processed {processed} "
                                   f"fragment-tokens but accounts for {own}")
        if not record.get("final"):
            ledger.inexact_attempts.append(f"{name}/{attempt}")
        claimed = {(r, p): c for r, p, c in claims}
        for key, amount in returned.items():
            if amount > claimed.get(key, 0):
                ledger.problems.append(f"{name} attempt {attempt}: returns {amount} "
                                       f"fragment-tokens of its claim to round {key[0]}, which "
                                       f"was {claimed.get(key, 0)}")
        for round_index, fragment, claim in claims:
            stored = offers.get((round_index, name))
            # What an offer no merge took returned to the learner is counted by the offer
            # that carried it next, not here.
            kept = min(returned.get((round_index, fragment), 0), claim)
            if stored is None:
                ledger.add(name, "offer_not_stored", claim - kept)
                continue
            # The offer's attempt and claim come from the learner's manifest (`offer_fates`
            # checks them): one that is not a count here counts as never stored.
            why = _malformed_offer(stored)
            if why is not None:
                ledger.problems.append(f"{name}'s offer to round {round_index}: {why}")
                ledger.add(name, "offer_not_stored", claim - kept)
                continue
            if stored.get("attempt", -1) != attempt:
                ledger.add(name, "duplicate_offer", claim - kept)
                continue
            if stored.get("claim") is not None and stored["claim"] != claim:
                ledger.problems.append(f"{name} attempt {attempt}: round {round_index} offer "
                                       f"claims {stored['claim']} in the store, {claim} in "
                                       "the learner's record")
            matched.add((round_index, name))
            ledger.add(name, fates.get((round_index, name), "undecided"), claim - kept)
        ledger.add(name, "superseded_on_receipt", sum(book["superseded"]))
        status = record.get("status")
        lost = ("stopped_before_offer" if status in ("done", "superseded")
                else "left_before_offer" if status == "left" else "died_before_offer")
        ledger.add(name, lost, sum(book["unclaimed"]))
    for key, stored in sorted(offers.items()):
        if (key not in matched and _malformed_offer(stored) is None
                and stored.get("claim") is not None):
            ledger.problems.append(f"{key[1]}'s offer to round {key[0]} (attempt "
                                   f"{stored.get('attempt')}) is in no learner's record")
    return ledger


def _malformed_offer(stored: Any) -> str | None:
    """Why a stored offer's {attempt, claim} cannot be accounted, or None."""
    if not isinstance(stored, Mapping):
        return f"the stored offer must be an object, got {type(stored).__name__}"
    attempt, claim = stored.get("attempt", -1), stored.get("claim")
    if attempt != -1 and not ledger_count(attempt, MAX_ATTEMPT):
        return f"attempt must be an integer in [0, {MAX_ATTEMPT}], got {str(attempt)[:40]}"
    if claim is not None and not ledger_count(claim, MAX_INT):
        return f"claim must be an integer in [0, {MAX_INT}], got {str(claim)[:40]}"
    return None
