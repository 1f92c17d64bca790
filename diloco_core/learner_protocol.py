"""The learner's side of the round protocol as one typed state: what it has offered, declined
and received, and the rules that read it (offer, wait, decline; in flight; pacing; leaving).

`OfferBook` is pure and immutable (each rule returns a new book); the learner runtime
(`resources/learner/runtime.py`) holds one and asks it between two inner steps. Before it, the
runtime kept seven trackers of the same offers (the round answered, declined rounds, offers in
flight per fragment, offers awaiting their merge per round, the round each fragment was last
merged in, the step of each fragment's latest offer, the round last seen open), and two of them
answered "has the offer come back?" by different rules.

An offer is *pending* from the moment it is made until it is answered:
- a newer version of its fragment arrived whose merge took it or superseded it (the version
  held moved past the one held at the offer; a merge of an earlier round that did not take it
  moves the held version forward with it, see `received_merge`),
- or a merge of its round or a later one reached the learner (an offer that came after its
  round was decided: that merge came first and will not come again),
- or `patience` seconds passed (a round that merged nothing moves no version).
While an offer of a fragment is pending, the learner does not offer that fragment again (its
counters run from the last receipt, so the same tokens would count twice), and pacing counts
the learner's steps past it.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from diloco_core.config import ExperimentConfig
from diloco_core.round_protocol import OfferChoice, held_by_pacing, offer_choice

DECLINED_KEPT = 8      # declined rounds named in the heartbeat (the syncer reads the newest)


@dataclass(frozen=True)
class PendingOffer:
    """One offer awaiting its merge: its round and fragment, the fragment's version the learner
    held when it offered, its step counter then, and when (the learner's clock)."""

    round: int
    fragment: int
    version: int
    step: int
    since: float


@dataclass(frozen=True)
class OfferBook:
    answered: int = -1                                   # newest round offered or declined
    declined: tuple[int, ...] = ()                       # the newest rounds it declined
    pending: Mapping[int, PendingOffer] = field(default_factory=dict)       # round -> offer
    received_round: Mapping[int, int] = field(default_factory=dict)    # fragment -> round
    offered_at_step: Mapping[int, int] = field(default_factory=dict)   # fragment -> step
    round_seen: tuple[int, int] | None = None            # newest round seen open, tokens then
    offers: int = 0                                      # made by this process
    received: int = 0                                    # merged fragments taken

    # ---- answering the open round -----------------------------------------------------------
    def settle(self, versions: Sequence[int], now: float, patience: float) -> "OfferBook":
        """The book without the offers that have been answered (see the module's rules)."""
        kept = {r: p for r, p in self.pending.items()
                if not (versions[p.fragment] > p.version
                        or self.received_round.get(p.fragment, -1) >= p.round
                        or now - p.since > patience)}
        return self if len(kept) == len(self.pending) else replace(self, pending=kept)

    def in_flight(self, fragment: int) -> bool:
        """Whether an offer of `fragment` is pending (after `settle`)."""
        return any(p.fragment == fragment for p in self.pending.values())

    def choice(self, round_index: int, fragment: int, final: bool, steps_on_fragment: int,
               stopped: bool) -> OfferChoice:
        """The protocol's offer rule for the open round (after `settle`)."""
        return offer_choice(round_index, final, self.answered, steps_on_fragment,
                            in_flight=self.in_flight(fragment), stopped=stopped)

    def offered(self, round_index: int, fragment: int, version: int, step: int, now: float
                ) -> "OfferBook":
        return replace(self, answered=max(self.answered, round_index),
                       pending={**self.pending,
                                round_index: PendingOffer(round_index, fragment, version,
                                                          step, now)},
                       offered_at_step={**self.offered_at_step, fragment: step},
                       offers=self.offers + 1)

    def declined_round(self, round_index: int) -> "OfferBook":
        return replace(self, answered=max(self.answered, round_index),
                       declined=(*self.declined[-(DECLINED_KEPT - 1):], round_index))

    # ---- receiving --------------------------------------------------------------------------
    def received_merge(self, fragment: int, version: int, merged_round: int | None,
                       fate: str) -> "OfferBook":
        """A newer version of `fragment` was taken. Under fate "pending" (an earlier round's
        merge, not the one its offer went to) the offer stays pending: its held version moves
        to the new one, so only a later version answers it."""
        pending = dict(self.pending)
        if fate == "pending":
            for r, p in self.pending.items():
                if p.fragment == fragment:
                    pending[r] = replace(p, version=version)
        received_round = dict(self.received_round)
        if merged_round is not None:
            received_round[fragment] = max(received_round.get(fragment, -1), merged_round)
        return replace(self, pending=pending, received_round=received_round,
                       received=self.received + 1)

    # ---- pacing and leaving -----------------------------------------------------------------
    def saw_round(self, newest_round: int, tokens_total: int) -> "OfferBook":
        """Remember the newest round seen open and the learner's tokens when it first saw it."""
        if self.round_seen is None or newest_round > self.round_seen[0]:
            return replace(self, round_seen=(newest_round, tokens_total))
        return self

    def must_wait(self, step: int, tokens_total: int, step_tokens: int,
                  cfg: ExperimentConfig) -> bool:
        """Pacing (`sync.block_on_overlap`), after `settle` and `saw_round`: the protocol's
        rule, as in the simulator."""
        since = 0 if self.round_seen is None else tokens_total - self.round_seen[1]
        return held_by_pacing(step, [p.step for p in self.pending.values()], since,
                              step_tokens, cfg)

    def nothing_left_to_offer(self, fragment: int, steps_on_fragment: int, step: int) -> bool:
        """A leaving learner's news on `fragment` is all offered: none since it last received
        the fragment, or its latest offer was made after its last step."""
        return steps_on_fragment < 1 or self.offered_at_step.get(fragment) == step
