"""Where each learner pauses near the end of the token budget, until the syncer says more.

The syncer writes STOP once the learners' credited tokens reach the budget
(`syncer_machine._maybe_stop`), and a learner hears of it a heartbeat, a tick and a poll later:
seconds. On a small model a second of training is several percent of the budget (issue 36
measured +29% to +52% over it on the `tiny` preset, the medians at M = 1, 2 and 4, while the
syncer was still compiling its first merges). So near the end the syncer also publishes a
forecast: for each learner training, a *target*, its total as the syncer last read it plus its
share (by configured speed) of the tokens that remain. A learner pauses once its own total
reaches its target, beats at once, and waits for the next forecast or for STOP. Each forecast
splits what is still left again, so the learners' totals converge on the budget whatever
their real speeds, and STOP still comes from the machine's count alone.

Trust. The remaining tokens are the budget minus the machine's own credited count (what STOP
uses), so a learner's claims move the others' targets no more than they move STOP; a learner's
own claim sets only its own target. A learner that cannot trust a forecast (malformed, or none
newer for `PAUSE_SECONDS`) trains on: a forecast can shorten a learner's training only until
the next one, never end the run.

Nothing here is imported by the simulator: its learners see STOP at the tick that writes it.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

from diloco_core.config import ExperimentConfig
from diloco_core.round_records import MAX_INT, Check, Heartbeat, _int, _map, _num, _Record
from diloco_core.syncer_events import Observed, StopRun
from diloco_core.syncer_machine import SyncerState, step

# Published once the budget is this close at the rate the syncer counts tokens (before a rate
# is known, always): a long run writes forecasts only in its last minute.
HORIZON_SECONDS = 60.0
# A learner paused at its target trains on if no newer forecast (or STOP) has come in this
# long: a syncer that died mid-forecast costs an overshoot, never a stalled run.
PAUSE_SECONDS = 20.0
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


def counted_tokens(state: SyncerState, obs: Observed, cfg: ExperimentConfig) -> int | None:
    """The tokens the machine counts toward the budget after this observation, or None once
    it has stopped. Asked of the machine itself (a step against a budget of one token, whose
    STOP names its count; `step` changes nothing of the caller's) so that the forecast can
    never count differently from the rule that ends the run."""
    if state.stop or state.finished:
        return None
    probe = step(state, replace(obs, budget=1, stop_request=None), cfg)
    return next((a.tokens for a in probe.actions if isinstance(a, StopRun)), 0)


def forecast(counted: int, budget: int, beats: Mapping[str, Heartbeat | None],
             absent: frozenset[str], speeds: Mapping[str, float], now: float
             ) -> BudgetForecast:
    """Each training learner's target: its claimed total plus its share, by configured speed,
    of `budget - counted` (rounded up, so that the shares together cover what remains)."""
    training = {n: b for n, b in beats.items()
                if b is not None and n not in absent and b.status in TRAINING}
    left = max(0, budget - counted)
    total_speed = sum(speeds.get(n, 1.0) for n in training)
    targets = {n: min(MAX_INT, b.tokens_total
                      + math.ceil(left * speeds.get(n, 1.0) / total_speed))
               for n, b in training.items()}
    return BudgetForecast(budget, counted, now, targets)


def near_end(counted: int, budget: int, tokens_per_second: float | None) -> bool:
    """Whether a forecast is worth publishing: the budget is within `HORIZON_SECONDS` at the
    counted rate, or no rate is known yet. Not while the count stands still: no one is
    nearing a target then (learners paused at theirs train on after `PAUSE_SECONDS`)."""
    if tokens_per_second is None:
        return True
    return budget - counted <= tokens_per_second * HORIZON_SECONDS
