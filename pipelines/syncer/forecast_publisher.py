"""The decider's budget forecast, written to the store near the end of the run.

`diloco_core/budget_forecast.py` says what a forecast is and why; this writes one (`FORECAST`,
a moving record the learners poll) from the tick's observation, at most once a second (GCS
takes about one update a second to an object), only within `HORIZON_SECONDS` of the budget at
the rate the machine's count has been growing, and only when a target moved or the last one
is `REFRESH_SECONDS` old (a learner trains on past a target no forecast has confirmed for
`PAUSE_SECONDS`: a live decider confirms them).
"""

import math
from collections import deque
from collections.abc import Callable

from diloco_core.budget_forecast import BudgetForecast, credited_now, forecast, near_end
from diloco_core.config import ExperimentConfig
from diloco_core.syncer_events import Observed
from diloco_core.syncer_machine import SyncerState
from resources.store.artifact_store import ArtifactStore

WRITE_SECONDS = 1.0        # at most one forecast a second
# Every learner at its target and the count unchanged this long: the count waits on progress
# no offer will credit soon (with no peer to compare with, M <= 2, a learner is credited only as
# its offers are merged), so the next targets start from the learners' own totals.
STALL_SECONDS = 3.0
REFRESH_SECONDS = 5.0      # the same targets written again this often (well inside PAUSE_SECONDS)
RATE_WINDOW_SECONDS = 30.0  # the counted rate: over the counts of the last this many seconds


class ForecastPublisher:
    """`state`: what an earlier publisher of this run kept (`state()`), for a decider that
    builds one per tick (the quorum sensor, whose cursor carries it): the counted rate, the
    last forecast, the stall clock. Without it such a decider would know no rate and write
    forecasts only past half the budget."""

    def __init__(self, store: ArtifactStore, cfg: ExperimentConfig,
                 guard: Callable[[], None], state: dict | None = None):
        self.store, self.cfg, self.guard = store, cfg, guard
        self._speeds = dict(zip(cfg.learners.learner_names, cfg.learners.learner_speeds,
                                strict=True))
        self._reset()
        self._restore(state)

    def _reset(self) -> None:
        self._counted_at = -math.inf
        self._counts: deque[tuple[float, int]] = deque()    # (time, counted)
        self._written: BudgetForecast | None = None
        self._moved_at = -math.inf      # when the count last changed
        self._near = False              # within the horizon (see `tick`)
        self._from_totals = False       # targets from the learners' totals (see `_stalled`)

    def state(self) -> dict:
        """The publisher's memory as plain JSON (no infinities)."""
        finite = (lambda t: t if math.isfinite(t) else None)
        return {"counted_at": finite(self._counted_at), "counts": [list(c) for c in self._counts],
                "written": None if self._written is None else self._written.to_json(),
                "moved_at": finite(self._moved_at), "near": self._near,
                "from_totals": self._from_totals}

    def _restore(self, state: dict | None) -> None:
        """An earlier publisher's memory; anything malformed is dropped (a fresh publisher:
        it costs at most a late forecast, never a wrong one)."""
        if not isinstance(state, dict):
            return
        try:
            counts = [(float(t), int(c)) for t, c in state.get("counts", [])]
            written = state.get("written")
            self._written = None if written is None else BudgetForecast.from_json(written)
            self._counts = deque(counts[-int(RATE_WINDOW_SECONDS * 2 / WRITE_SECONDS):])
            for name in ("counted_at", "moved_at"):
                value = state.get(name)
                setattr(self, f"_{name}", -math.inf if value is None else float(value))
            self._near = bool(state.get("near", False))
            self._from_totals = bool(state.get("from_totals", False))
        except (TypeError, ValueError):      # RecordError is a ValueError
            self._reset()

    def tick(self, before: SyncerState, observed: Observed, after: SyncerState) -> None:
        """After a tick that did not stop the run: count (once a second at most) and write a
        forecast if the end is near and a target moved. `before`, `observed` and `after` are
        the tick's own, so the count is the one its STOP rule saw."""
        now = observed.now
        if after.stop or after.finished or observed.budget is None:
            return
        if now - self._counted_at < WRITE_SECONDS:
            return
        counted = sum(credited_now(before, after, observed, self.cfg).values())
        self._counted_at = now
        if not self._counts or self._counts[-1][1] != counted:
            self._moved_at, self._from_totals = now, False
        self._counts.append((now, counted))
        while self._counts and now - self._counts[0][0] > RATE_WINDOW_SECONDS:
            self._counts.popleft()
        rate = self._rate()
        # Near the end a count that stands still stays near it (the learners wait on it).
        self._near = near_end(counted, observed.budget, rate) or (
            self._near and (rate is None or rate <= 0))
        if not self._near:
            return
        credit = credited_now(before, after, observed, self.cfg, in_flight=True)
        # Until the count moves again (each learner's own claim moves only its own target).
        self._from_totals = self._from_totals or self._stalled(observed, now)
        start = None
        if self._from_totals:
            start = {n: max(credit.get(n, 0), b.tokens_total)
                     for n, b in observed.beats.items() if b is not None}
        made = forecast(credit, observed.budget, observed.beats, observed.absent, self._speeds,
                        now, start)
        if (self._written is not None and made.targets == self._written.targets
                and now - self._written.at < REFRESH_SECONDS):
            return
        self.guard()
        self.store.put_budget_forecast(made)
        self._written = made

    def _stalled(self, observed: Observed, now: float) -> bool:
        """Every learner the last forecast named is at its target there, and the count has
        not moved for `STALL_SECONDS`."""
        if self._written is None or now - self._moved_at < STALL_SECONDS:
            return False
        beats = observed.beats
        return all((b := beats.get(n)) is None or b.tokens_total >= target
                   for n, target in self._written.targets.items())

    def _rate(self) -> float | None:
        """Counted tokens a second over the window, None until it spans two seconds."""
        (t0, c0), (t1, c1) = self._counts[0], self._counts[-1]
        return (c1 - c0) / (t1 - t0) if t1 - t0 >= 2.0 else None
