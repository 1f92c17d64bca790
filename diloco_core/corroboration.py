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
- **Weights.** No member's merge weight exceeds `max(max_weight_share, 1 / members)` (0.75 by
  default: at most 3x the rest of its round together), or the
  share its configured batch gives it when that is larger (unequal batches keep their token
  weighting); the excess goes to the others in proportion to their own weights.
- **Heartbeats.** A learner's total tokens count toward the budget only up to the largest
  total among the other live learners (one sync period's progress of slack), and toward the
  opening of rounds up to `max_speed_ratio` times that, once at least two others are live to
  compare with: a learner claiming 2^62 tokens ends the run no sooner than one more honest
  learner would, and opens rounds no faster than `max_speed_ratio` times the fastest honest
  one. With fewer live learners there is nobody to compare against, and claims count as made.
- **The syncer's own account** (`credited`, kept in the syncer's state), where fewer than two
  other learners are live to compare with: a heartbeat's total counts at most what the
  learner had when the account began plus twice what its offers carried on one fragment
  since, plus one sync period, and never less than one round's worth past its total when the
  open round opened (so rounds always open). With M = 2 a claim of 2^62 tokens counts as one
  learner at the pace of the rounds, or, offering every round with claims at the credit cap,
  as about 2 x `max_speed_ratio` honest learners.
"""

import math
from collections.abc import Mapping, Sequence

import numpy as np

from diloco_core.config import ExperimentConfig
from diloco_core.round_protocol import tokens_needed
from diloco_core.round_records import Heartbeat


def offer_step_bound(sync_period: int, staleness: int, max_speed_ratio: float) -> int:
    """The most inner steps an offer `staleness` global versions behind can be credited."""
    if math.isinf(max_speed_ratio):
        return 2 ** 62
    return max(1, math.ceil(max_speed_ratio * sync_period * (1 + max(0, staleness))))


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


# Each fragment's offers together carry about all of a learner's tokens (each offer, its
# progress since it last received the fragment), less what a receive rule discarded between an
# offer and its receipt: the account credits up to this many times what the offers carried.
ACCOUNT_RATIO = 2.0


def account_bound(account: Mapping[int, int], base: int, at_open: int, needed: int,
                  slack: int) -> int:
    """The most total tokens the syncer credits a learner on its own account: what it was
    credited when this account began (`base`: 0 at the start of the run, or the last round's
    record when a syncer rebuilt its state), plus ACCOUNT_RATIO times the largest sum of
    credited tokens it has offered since on any one fragment, plus `slack` (one sync period:
    its progress since its last offer). Never less than its total when the open round opened
    plus the tokens one round needs (`at_open + needed`), so that the next round can always
    open: a learner offers only to open rounds. Without offers a claim grows by one round's
    worth per round opened, as an honest learner at the pace of the rounds would."""
    by_offers = base + int(ACCOUNT_RATIO * max(account.values(), default=0)) + slack
    return max(by_offers, at_open + needed)


def credited(accounts: Mapping[str, Mapping[int, int]], bases: Mapping[str, int],
             at_open: Mapping[str, int], beats: Mapping[str, Heartbeat | None],
             live: Sequence[str], cfg: ExperimentConfig
             ) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
    """(totals for the budget, totals for opening rounds, why claims were clipped): each
    heartbeat's total as far as the other live learners corroborate it (`credited_totals`),
    and where fewer than two others are live to compare with (M = 2, or the others down), as
    far as the syncer's own account of the learner does (`account_bound`)."""
    claimed = {n: b.tokens_total for n, b in beats.items() if b}
    needed = tokens_needed(cfg)
    slack = max(needed.values()) * cfg.sync.num_fragments
    ratio = cfg.sync.max_speed_ratio
    budget_tokens, clipped = credited_totals(claimed, live, 1.0, slack)
    opening, _ = credited_totals(claimed, live, ratio, slack)
    if math.isinf(ratio):
        return budget_tokens, opening, clipped
    live_set = set(live)
    for name in claimed:
        if len(live_set - {name}) >= 2:
            continue        # the peers corroborate it (credited_totals)
        bound = account_bound(accounts.get(name, {}), bases.get(name, 0),
                              at_open.get(name, 0), needed.get(name, 0), slack)
        if claimed[name] <= bound:
            continue
        budget_tokens[name] = min(budget_tokens[name], bound)
        opening[name] = min(opening[name], bound)
        clipped[name] = (f"claims {claimed[name]} tokens, credited {bound}: what it had when "
                         f"the syncer's account of it began, {ACCOUNT_RATIO:g}x what its offers "
                         f"carried on one fragment since, plus {slack}")
    return budget_tokens, opening, clipped
