"""Where each learner pauses near the end of the token budget, until the syncer says more.

The syncer writes STOP once the learners' credited tokens reach the budget
(`syncer_machine._maybe_stop`), and a learner hears of it a heartbeat, a tick and a poll later:
seconds. On a small model a second of training is several percent of the budget (issue 36
measured +29% to +52% over it on the `tiny` preset, the medians at M = 1, 2 and 4, while the
syncer was still compiling its first merges). So near the end the syncer also publishes a
forecast: for each learner training, a *target*, its tokens as the machine credits them (with
the merges in flight) plus its share (by configured speed) of the tokens that remain. A
learner pauses once its own total reaches its target, beats at once, and waits for the next
forecast or for STOP. Each forecast splits what is still left again, so the learners' totals
converge on the budget whatever their real speeds, and STOP still comes from the machine's
count alone.

Trust. Targets come from the machine's own credited count (what STOP uses), so a learner's
claims move the others' targets no more than they move STOP, and past its credit they move
nothing at all. A learner that cannot trust a forecast (malformed, or none newer for
`PAUSE_SECONDS`: the decider writes the same targets again every few seconds while it lives)
trains on: a forecast can hold a learner back only until the next one, never end the run.

Nothing here is imported by the simulator: its learners see STOP at the tick that writes it.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from diloco_core.config import ExperimentConfig
from diloco_core.liveness import live_learners
from diloco_core.round_records import MAX_INT, Check, Heartbeat, _int, _map, _num, _Record
from diloco_core.syncer_account import credited
from diloco_core.syncer_events import Observed
from diloco_core.syncer_machine import SyncerState, _marker_view

# Published once the budget is this close at the rate the syncer counts tokens (before a rate
# is known, past half the budget): a long run writes forecasts only in its last minute.
HORIZON_SECONDS = 60.0
# A learner paused at its target trains on if no newer forecast (or STOP) has come in this
# long: a syncer that died mid-forecast costs an overshoot, never a stalled run. Longer than a
# syncer's tick is held up by its first merges' compilation on a loaded machine (14 s seen on
# `tiny` with a cold cache, M = 2: at 20 s the learners trained on, 24-35% past the budget),
# and than a syncer relaunch (13-20 s in the chaos soak; the warm standby takes about 1 s).
PAUSE_SECONDS = 60.0
# Statuses of a learner that is training (or about to): only these get a share.
TRAINING = frozenset({"starting", "training"})


@dataclass(frozen=True)
class BudgetForecast(_Record):
    """`targets`: learner -> the claimed total at which it pauses; `counted`: the machine's
    credited tokens when it was made; `at`: the syncer's clock then (for people)."""

    KIND: ClassVar[str] = "budget_forecast"
    CHECKS: ClassVar[dict[str, Check]] = {
        "budget": _int(1), "counted": _int(), "at": _num(), "targets": _map(_int())}

    budget: int
    counted: int
    at: float
    targets: Mapping[str, int] = field(default_factory=dict)


def credited_now(before: SyncerState, after: SyncerState, obs: Observed,
                 cfg: ExperimentConfig, in_flight: bool = False) -> dict[str, int]:
    """Each learner's tokens as the tick that went from `before` to `after` on `obs` counted
    them toward the budget: `syncer_machine.step`'s own call of `syncer_account.credited`, on
    the accounts the tick booked (its only changes to them come before that call), the
    liveness it observed, and the state's tokens at the open round before the tick (a round
    it opened sets them after). `tests/test_budget_forecast.py` holds the sum to the count at
    which the machine writes STOP, tick by tick. (A field of `Stepped` would say it once; the
    machine is left as it is while the quality benchmarks' results are keyed to its code.)

    `in_flight`: as the machine will count them once the merges it decided are published,
    each member's credit for its offer booked (a learner with no peer to compare with, M <= 2,
    is credited only as its offers are merged: without this its targets would count those
    tokens twice). A merge that refuses an offer books nothing; the next forecast then shares
    what that leaves."""
    accounts = after.accounts.offered
    if in_flight:
        accounts = {n: dict(a) for n, a in accounts.items()}
        for pending in after.pending:
            for member, tokens in pending.credits.items():
                account = accounts.setdefault(member, {})
                account[pending.fragment] = account.get(pending.fragment, 0) + tokens
    views = {n: _marker_view(b) for n, b in obs.beats.items()}
    live = [n for n in live_learners(views, after.seen, obs.now,
                                     cfg.orchestration.learner_timeout_seconds)
            if n not in obs.absent]
    tokens, _, _ = credited(accounts, before.accounts.base,
                            before.tokens_at_open, obs.beats, live, cfg,
                            {n: obs.now - at for n, at in after.accounts.began.items()})
    return tokens


def forecast(credited_tokens: Mapping[str, int], budget: int,
             beats: Mapping[str, Heartbeat | None], absent: frozenset[str],
             speeds: Mapping[str, float], now: float,
             start: Mapping[str, int] | None = None) -> BudgetForecast:
    """Each training learner's target: where it starts (`start`, by default what the machine
    credits it with) plus its share, by configured speed, of the budget less everyone's
    credit (rounded up, so that the shares together cover what remains). Starting from its
    credit, a learner's total past it (progress its offers have not corroborated yet, with no
    peer to compare with: M <= 2) is part of its share, so honest learners' totals together
    stop at the budget."""
    start = credited_tokens if start is None else start
    training = [n for n, b in beats.items()
                if b is not None and n not in absent and b.status in TRAINING]
    counted = sum(credited_tokens.values())
    left = max(0, budget - counted)
    total_speed = sum(speeds.get(n, 1.0) for n in training)
    targets = {n: min(MAX_INT, start.get(n, 0)
                      + math.ceil(left * speeds.get(n, 1.0) / total_speed))
               for n in training}
    return BudgetForecast(budget, counted, now, targets)


def near_end(counted: int, budget: int, tokens_per_second: float | None) -> bool:
    """Whether a forecast is worth publishing: the budget is within `HORIZON_SECONDS` at the
    counted rate or, before a rate is known, half of it is counted (a decider that keeps no
    rate, the quorum sensor's fallback with a controller per tick, then writes forecasts over
    the second half of a run only). A count that stands still is not near by itself; the
    writer keeps forecasting through a standstill once it is near (`forecast_publisher.py`)."""
    if tokens_per_second is None:
        return 2 * counted >= budget
    return budget - counted <= tokens_per_second * HORIZON_SECONDS
