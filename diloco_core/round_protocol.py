"""The round protocol: when a round opens, when a learner offers, when a round is decided,
when the run stops. One set of pure rules, run by every party that needs them:

- the reference simulator (`simulator.py`, on its fake clock),
- the syncer service and the quorum sensor's fallback (`pipelines/syncer/round_control.py`, on the
  syncer's wall clock, reading learners' records from the store),
- the learner runtime (`resources/learner/runtime.py`: whether and what to offer).

The rules:

1. Round r syncs fragment r mod P. One round is open at a time: round r+1 opens once round r is
   decided and at least K live learners have each processed H/P steps' worth of their own batch
   tokens since round r opened (`ready_to_open`). Tokens, not steps: a learner's step count
   restarts from a peer's when it rejoins; its tokens are its own.
2. A learner offers the open round the fragment's progress since it last *received* that
   fragment (`offer_choice`), unless an earlier offer of the fragment is still in flight (its
   tokens would count twice in the merge weights) or it has nothing new (then it waits for
   its next step, or declines when it can never answer otherwise: a final round, or any
   round once it has stopped training, e.g. the round open at STOP).
3. An open round is decided by the quorum + grace-window policy (`quorum.decide`). After STOP
   (the learners' tokens reached the budget) a round waits for every live learner instead,
   up to the round timeout, skipping learners that declined it (`decide_round`).
4. At the budget, STOP, then P final rounds, one per fragment, so the final global parameters
   hold every learner's last progress (`final_rounds`). Then the run is finished.
"""

import math
from collections.abc import Collection, Mapping
from typing import Literal

from diloco_core.config import ExperimentConfig
from diloco_core.quorum import Decision, Estimates, decide

OfferChoice = Literal["offer", "wait", "decline", "answered"]


def tokens_needed(cfg: ExperimentConfig) -> dict[str, int]:
    """Tokens each learner processes in H/P of its own steps: the progress that makes it ready
    for the next round."""
    interval = cfg.sync.round_interval_steps
    return {name: interval * tokens for name, tokens
            in zip(cfg.learners.learner_names, cfg.learner_step_tokens, strict=True)}


def ready_to_open(tokens_since_open: Mapping[str, int], needed: Mapping[str, int],
                  live: Collection[str], min_quorum: int, previous_decided: bool) -> bool:
    """Rule 1: whether the next round opens now."""
    if not previous_decided:
        return False
    ready = [n for n in live if tokens_since_open.get(n, 0) >= needed.get(n, math.inf)]
    return len(ready) >= min_quorum


def offer_choice(round_index: int, final: bool, last_answered: int, steps_on_fragment: int,
                 in_flight: bool, stopped: bool = False) -> OfferChoice:
    """Rule 2, for one learner and the open round of one fragment.

    `last_answered`: the newest round this learner offered or declined (offers are write-once:
    a round is answered once). `steps_on_fragment`: its steps since it last received the
    fragment (the counters an offer carries). `in_flight`: an earlier offer of this fragment
    awaits its merge. `stopped`: the learner trains no more (STOP, or it is leaving)."""
    if round_index <= last_answered:
        return "answered"
    if in_flight:
        return "wait"
    if steps_on_fragment < 1:
        # A learner that trains no more never will have news: it answers at once, so that the
        # round (which after STOP waits for every live learner) does not wait out its timeout
        # for it. A learner still training offers after its next step, or the round could be
        # left without offers when every learner received the fragment as it opened.
        return "decline" if final or stopped else "wait"
    return "offer"


def held_by_pacing(step: int, offered_at_steps: Collection[int], tokens_since_round_seen: int,
                   step_tokens: int, cfg: ExperimentConfig) -> bool:
    """Rule 1, the learner's side (`sync.block_on_overlap`): whether it waits before its next
    step. It does while it is tau steps past an offer whose merged fragment has not come back
    (`offered_at_steps`: its step counter at each such offer), or H/P + tau steps' worth of
    its own tokens past the newest round it has seen open. The simulator and the learner
    runtime both ask this."""
    if not cfg.sync.block_on_overlap:
        return False
    if any(step >= at + cfg.sync.overlap_steps for at in offered_at_steps):
        return True
    return past_the_overlap_bound(tokens_since_round_seen, step_tokens, cfg)


def past_the_overlap_bound(tokens_since_round_seen: int, step_tokens: int, cfg: ExperimentConfig
                           ) -> bool:
    """Rule 1, the learner's side, when it blocks on the overlap bound (synchronous DiLoCo):
    it stops once it processed H/P + tau steps' worth of its own tokens since it saw the
    newest round open. Tokens, as the syncer counts them: a learner that started from a peer's
    AdamW state carries the peer's step counter but only its own tokens, and counting steps
    here stopped it short of what the syncer waits for (a deadlock at K = M)."""
    s = cfg.sync
    return tokens_since_round_seen >= (s.round_interval_steps + s.overlap_steps) * step_tokens


def budget_reached(tokens_total: Mapping[str, int], budget: int) -> bool:
    """Rule 4: STOP once the learners' tokens together reach the budget."""
    return sum(tokens_total.values()) >= budget


def final_rounds(num_fragments: int) -> int:
    """Rule 4: after STOP, one final round per fragment."""
    return num_fragments


def decide_round(now: float, arrivals: Mapping[str, float], live: Collection[str],
                 estimates: Estimates, cfg: ExperimentConfig, *, stopping: bool,
                 opened_at: float, declined: Collection[str] = (),
                 refused: Collection[str] = ()) -> Decision:
    """Rule 3: the decision on the open round at `now`. `arrivals`: learner -> when its offer
    arrived (the decider's clock); `stopping`: STOP was written (or the round is final).
    After STOP the round waits for an answer from every live learner: an offer, a decline
    (`declined`), or an offer the decider refused (`refused`: its learner counts the round
    answered and will not offer it again, so waiting for it could only run out the timeout)."""
    if not stopping:
        return decide(now, arrivals, live, estimates, cfg.sync)
    members = tuple(sorted(arrivals, key=lambda n: (arrivals[n], n)))
    unmerged = set(live) - set(arrivals)
    skipped = sorted(unmerged & set(declined) - set(refused))
    turned_away = sorted(unmerged & set(refused))
    missing = tuple(sorted(unmerged - set(declined) - set(refused)))
    waited = now - opened_at
    if missing and waited < cfg.orchestration.round_timeout_seconds:
        return Decision(False, (), (), missing, f"final round waiting for {', '.join(missing)}")
    why = ("every live learner offered" if not missing else
           f"final round timed out after {waited:.0f}s without {', '.join(missing)}")
    if skipped:
        why += f" ({', '.join(skipped)}: nothing new on this fragment)"
    if turned_away:
        why += f" ({', '.join(turned_away)}: offer refused)"
    return Decision(True, members, (), missing, f"final round: {why}")
