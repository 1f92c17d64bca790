"""The syncer's own account of each learner: how far a heartbeat's total tokens count where no
peers are there to corroborate it.

A heartbeat's total decides when the run stops (the token budget) and when rounds open, and
the learner writes it. With at least two other live learners, `corroboration.credited_totals`
holds it to what the others report. With fewer (M = 2, or the others down) nobody can, so the
syncer uses what it observed itself: the offers it saw from the learner, each credited only
as far as the protocol's pace allows (`corroboration.credit_offer`), summed per fragment in its
state (`syncer_machine.SyncerState.accounts`). A learner has to offer for its tokens; without
offers it counts as one learner at the pace of the rounds, so that rounds always open.
"""

import math
from collections.abc import Mapping, Sequence

from diloco_core.config import ExperimentConfig
from diloco_core.corroboration import credited_totals
from diloco_core.round_protocol import tokens_needed
from diloco_core.round_records import Heartbeat

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


def offered_bound(account: Mapping[int, int], base: int, slack: int) -> int:
    """What the learner's own offers corroborate of its total: its credited total when the
    account began, plus the largest sum of credited tokens it offered on any one fragment
    since (each fragment's offers carry about all of its progress), plus `slack` (its
    progress since its last offer)."""
    return base + max(account.values(), default=0) + slack


def credited(accounts: Mapping[str, Mapping[int, int]], bases: Mapping[str, int],
             at_open: Mapping[str, int], beats: Mapping[str, Heartbeat | None],
             live: Sequence[str], cfg: ExperimentConfig,
             seconds: Mapping[str, float] | None = None
             ) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
    """(totals for the budget, totals for opening rounds, why claims were clipped).

    With at least two other live learners to compare with, a heartbeat's total counts toward
    the budget as far as the others corroborate it (`credited_totals`: the largest other's
    total plus one sync period) *or* its own offers do (`offered_bound`), whichever allows
    more, up to `max_speed_ratio` times the largest other: a learner honestly faster than
    every peer is corroborated by what it offered; one that claims 2^62 without offering
    counts as one more honest learner, and one that offers at the credit cap every round as
    up to `max_speed_ratio` (the syncer cannot tell it from an honest learner that fast).
    Toward opening rounds, `max_speed_ratio` times the largest other. With fewer than two
    others live (M = 2, or the others down) nobody can compare, and the syncer's own account
    bounds it (`account_bound`). Where the deployment declares its hardware's fastest rate
    (`sync.max_learner_tokens_per_second`), every total is also held to what that rate allows
    in the `seconds` since the learner's account began (`rate_bound`); toward opening rounds
    never below one round's worth past its total at the open round."""
    claimed = {n: b.tokens_total for n, b in beats.items() if b}
    needed = tokens_needed(cfg)
    slack = max(needed.values()) * cfg.sync.num_fragments
    ratio = cfg.sync.max_speed_ratio
    budget_tokens, clipped = credited_totals(claimed, live, 1.0, slack)
    opening, _ = credited_totals(claimed, live, ratio, slack)
    for name in list(clipped):
        # Beyond the largest other's total, as far as its own offers corroborate, and never
        # past max_speed_ratio times it (what it counts for toward opening rounds).
        own = min(offered_bound(accounts.get(name, {}), bases.get(name, 0), slack),
                  opening[name])
        if claimed[name] <= own:
            budget_tokens[name] = claimed[name]
            del clipped[name]
        elif own > budget_tokens[name]:
            budget_tokens[name] = own
            clipped[name] += f"; its offers corroborate {own}"
    if not math.isinf(ratio):
        _hold_to_account(accounts, bases, at_open, claimed, live, needed, slack,
                         budget_tokens, opening, clipped)
    _hold_to_rate(claimed, bases, seconds or {}, at_open, needed, slack, cfg, budget_tokens,
                  opening, clipped)
    return budget_tokens, opening, clipped


def _hold_to_account(accounts: Mapping[str, Mapping[int, int]], bases: Mapping[str, int],
                     at_open: Mapping[str, int], claimed: Mapping[str, int],
                     live: Sequence[str], needed: Mapping[str, int], slack: int,
                     budget_tokens: dict[str, int], opening: dict[str, int],
                     clipped: dict[str, str]) -> None:
    """With fewer than two others live, the syncer's own account bounds a total."""
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


def rate_bound(base: int, seconds: float, rate: float, slack: int) -> int:
    """The most total tokens a learner can have processed `seconds` after its account began
    with `base`, at no more than `rate` tokens a second, plus `slack` (one sync period: what
    it may have had in flight when the account began)."""
    return base + int(rate * max(0.0, seconds)) + slack


def _hold_to_rate(claimed: Mapping[str, int], bases: Mapping[str, int],
                  seconds: Mapping[str, float], at_open: Mapping[str, int],
                  needed: Mapping[str, int], slack: int, cfg: ExperimentConfig,
                  budget_tokens: dict[str, int], opening: dict[str, int],
                  clipped: dict[str, str]) -> None:
    rate = cfg.sync.max_learner_tokens_per_second
    if math.isinf(rate):
        return
    for name, total in claimed.items():
        if name not in seconds:
            continue
        bound = rate_bound(bases.get(name, 0), seconds[name], rate, slack)
        if total <= bound:
            continue
        # Never below one round's worth past its total at the open round: rounds always open
        # (as `account_bound`).
        opening[name] = min(opening[name], max(bound, at_open.get(name, 0)
                                               + needed.get(name, 0)))
        if budget_tokens[name] <= bound:
            continue        # a tighter bound holds it toward the budget already
        budget_tokens[name] = bound
        clipped[name] = (f"claims {total} tokens, credited {bound}: more than "
                         f"max_learner_tokens_per_second ({rate:g}) allows in the "
                         f"{seconds[name]:.0f} s the syncer has known it")
