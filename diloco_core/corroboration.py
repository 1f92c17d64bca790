"""How far the syncer believes a learner's counters: what it can bound from its own view.

A learner reports its own tokens and steps (in each offer, since it last received the fragment;
in each heartbeat, in total). They decide merge weights (w = tokens^2 / steps), the norm screen
(per step), when the run stops (the token budget) and when rounds open, so one learner that
lies about them could take the merge over or end the run. Nothing here trusts them further than
the syncer can corroborate:

- **Offers.** Steps since a learner last received a fragment are bounded by the protocol the
  syncer runs: a learner syncs each fragment every H inner steps, and a learner `s` versions
  behind missed about s syncs, so an honest offer carries about H (1 + s) steps. A learner
  `max_speed_ratio` times faster than the pace of rounds is credited at most
  `max_speed_ratio * H * (1 + s)` steps, and tokens at most its steps times the tokens of one
  of its steps (its configured batch). The norm screen divides by the credited steps, so a
  claim of 10^12 steps no longer shrinks a huge outer gradient to a small one per step.
  Versions publish only while the syncer merges, so when it stalls (compiling its first merges,
  or down) honest learners go on training and their next offers carry more steps than the
  versions account for. The round's other members corroborate that: an offer is also credited
  up to `max_speed_ratio` times the fewest steps another member of its round offered
  (`peer_step_bound`). The fewest, so that one honest member is enough to hold a liar to
  `max_speed_ratio` honest learners; a liar claiming nothing holds an honest member back no
  further than the versions' pace. (At M = 2 the stall's offers, credited nothing, left the
  syncer's count 25% behind the learners' true totals: the budget overshot by 9%.)
- **Weights.** No member's merge weight exceeds `max(max_weight_share, 1 / members)` (0.75 by
  default: at most 3x the rest of its round together), or the
  share its configured batch gives it when that is larger (unequal batches keep their token
  weighting); the excess goes to the others in proportion to their own weights.
- **Heartbeats.** A learner's total tokens count toward the budget only up to the largest
  total among the other live learners (one sync period's progress of slack), and toward the
  opening of rounds up to `max_speed_ratio` times that, once at least two others are live to
  compare with: a learner claiming 2^62 tokens ends the run no sooner than one more honest
  learner would, and opens rounds no faster than `max_speed_ratio` times the fastest honest
  one. With fewer live learners there is nobody to compare against, and claims count as made;
  the syncer's own account of the learner (`syncer_account`) bounds them then.
"""

import math
from collections.abc import Mapping, Sequence

import numpy as np


def offer_step_bound(sync_period: int, staleness: int, max_speed_ratio: float) -> int:
    """The most inner steps an offer `staleness` global versions behind can be credited."""
    if math.isinf(max_speed_ratio):
        return 2 ** 62
    return max(1, math.ceil(max_speed_ratio * sync_period * (1 + max(0, staleness))))


def peer_step_bound(pace_bound: int, other_steps: Sequence[int], max_speed_ratio: float
                    ) -> int:
    """The most inner steps an offer can be credited given the other members of its round:
    `pace_bound` (`offer_step_bound`), or `max_speed_ratio` times the fewest steps another
    member offered, whichever is larger. No other member: `pace_bound`."""
    if not other_steps or math.isinf(max_speed_ratio):
        return pace_bound
    return max(pace_bound, math.ceil(max_speed_ratio * max(0, min(other_steps))))


def credit_offer(tokens: int, steps: int, step_tokens: int | None, step_bound: int
                 ) -> tuple[int, int, str | None]:
    """(credited tokens, credited steps, why they were clipped or None)."""
    credited_steps = min(steps, step_bound)
    credited_tokens = tokens if step_tokens is None else min(tokens,
                                                             credited_steps * step_tokens)
    if credited_steps == steps and credited_tokens == tokens:
        return tokens, steps, None
    return credited_tokens, credited_steps, (
        f"claimed {tokens} tokens in {steps} steps; credited {credited_tokens} in "
        f"{credited_steps} (at most {step_bound} steps at this staleness"
        + ("" if step_tokens is None else f", {step_tokens} tokens a step") + ")")


def share_caps(members: Sequence[str], step_tokens: Mapping[str, int] | None,
               max_share: float) -> list[float]:
    """Each member's largest honest weight share: `max_share`, or the share its configured
    batch gives it (tokens^2 / steps at equal steps: batch^2 over the members' sum), if that
    is larger; so token weighting between unequal batches is kept, and no learner takes more
    than an honest learner with its batch would."""
    if step_tokens is None or any(m not in step_tokens for m in members):
        return [max_share] * len(members)
    squares = [float(step_tokens[m]) ** 2 for m in members]
    total = sum(squares)
    return [max(max_share, sq / total) for sq in squares]


def cap_shares(weights: Sequence[float], caps: Sequence[float]) -> np.ndarray:
    """Normalized weights with no entry above its cap (and never below 1/n for all): each
    capped entry is held at its cap and the rest share what is left in proportion to their
    weights (water-filling, at most n passes)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    n = len(w)
    cap = np.maximum(np.asarray(caps, dtype=np.float64), 1.0 / n)
    if np.all(w <= cap):
        return w
    capped = np.zeros(n, dtype=bool)
    for _ in range(n):
        over = (w > cap + 1e-12) & ~capped
        if not over.any():
            break
        capped |= over
        free = ~capped
        left = max(0.0, 1.0 - cap[capped].sum())
        w = np.where(capped, cap, w)
        total_free = w[free].sum()
        if total_free > 0:
            w[free] = w[free] / total_free * left
        elif free.any():
            w[free] = left / free.sum()
    return w / w.sum()


def credited_totals(claimed: Mapping[str, int], live: Sequence[str], ratio: float,
                    slack: int) -> tuple[dict[str, int], dict[str, str]]:
    """Each learner's total tokens as far as the others corroborate them, and why a claim was
    clipped: at most `ratio` times the largest total among the other live learners, plus
    `slack` (one sync period's worth: learners start and run at their own pace). Applied
    once at least two others are live: then one learner claiming nothing cannot hold the
    others back, and one claiming 2^62 counts as no more than `ratio` honest peers. `live`:
    learners whose heartbeats move (dead ones' totals are stale, no standard to compare)."""
    credited, clipped = {}, {}
    live_totals = {n: claimed[n] for n in live if n in claimed}
    # The largest of the others is the largest overall, or the runner-up for the learner that
    # holds it: one pass, not one per learner (M = 256 on every tick).
    top = sorted(live_totals.items(), key=lambda item: item[1], reverse=True)[:2]
    for name, tokens in claimed.items():
        others = len(live_totals) - (name in live_totals)
        if others < 2 or math.isinf(ratio):
            credited[name] = tokens
            continue
        largest = top[1][1] if top[0][0] == name else top[0][1]
        bound = int(ratio * largest) + slack
        credited[name] = min(tokens, bound)
        if tokens > bound:
            clipped[name] = (f"claims {tokens} tokens, credited {bound}: {ratio:g}x the "
                             f"largest of the other live learners ({largest}) plus {slack}")
    return credited, clipped
