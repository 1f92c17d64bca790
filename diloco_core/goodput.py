"""Goodput at datacentre scale: a discrete-event failure simulator (no ML).

N chips in slices of S chips. Each chip fails as a Poisson process with mean time between
interruptions MTBI, so the cluster sees failures at rate N / MTBI; a failure takes its slice out
for `repair_seconds` (a failure inside a slice already out changes nothing). Systems:

- data-parallel without elasticity: every failure stops the whole job for `restart_seconds`
  (it restarts on spare capacity); failures during a restart are absorbed by it;
- data-parallel with elasticity (slice granularity): every failure pauses the whole job for
  `downscale_seconds` and every repaired slice's return for `upscale_seconds`; in between it
  trains on the slices that are up;
- synchronous DiLoCo with M learners: each learner owns N/M chips and is elastic as above, but
  every sync waits for all learners, so any learner's pause stalls all of them;
- Decoupled DiLoCo with M learners: the same learners, but their pauses and lost slices are
  their own; the global model advances while at least K learners are training (uptime).

Goodput = useful chip-seconds / allocated chip-seconds. Failures are drawn once per seed and
shared by all systems, so they are compared on the same failure trace.
"""

import math
from dataclasses import dataclass

import numpy as np

SECONDS_PER_YEAR = 365 * 24 * 3600


@dataclass(frozen=True)
class GoodputParams:
    chips: int
    learners: int = 8
    min_quorum: int = 1
    mtbi_years: float = 1.0
    # Calibrated to the paper's published Table 1 cells (see docs/goodput.md): every cell
    # within 1.6 points at these values.
    slice_chips: int = 256
    repair_seconds: float = 2700.0
    restart_seconds: float = 76.0
    downscale_seconds: float = 20.0
    upscale_seconds: float = 0.0
    horizon_seconds: float = 24 * 3600.0

    def __post_init__(self):
        if self.chips < self.slice_chips or self.chips % self.slice_chips:
            raise ValueError(f"chips ({self.chips}) must be a positive multiple of "
                             f"slice_chips ({self.slice_chips})")
        if not 1 <= self.min_quorum <= self.learners:
            raise ValueError("min_quorum must be between 1 and learners")
        if (self.chips // self.slice_chips) < self.learners:
            raise ValueError("need at least one slice per learner")

    @property
    def num_slices(self) -> int:
        return self.chips // self.slice_chips


def _failures(p: GoodputParams, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Failure times and the slice each one hits, over the horizon."""
    rate = p.chips / (p.mtbi_years * SECONDS_PER_YEAR)
    count = rng.poisson(rate * p.horizon_seconds)
    times = np.sort(rng.uniform(0.0, p.horizon_seconds, count))
    return times, rng.integers(0, p.num_slices, count)


Outage = tuple[float, float, int]   # (down at, up at, slice)


def _outages(p: GoodputParams, times: np.ndarray, slices: np.ndarray) -> list[Outage]:
    """(down, up, slice) per failure that found its slice up."""
    up_at = np.zeros(p.num_slices)
    outages = []
    for t, s in zip(times.tolist(), slices.tolist(), strict=True):
        if t >= up_at[s]:
            up_at[s] = t + p.repair_seconds
            outages.append((t, t + p.repair_seconds, s))
    return outages


def _renewal(starts: list[float], length: float) -> list[tuple[float, float]]:
    """Stop intervals of `length` from each event, except events that arrive while stopped:
    those are absorbed by the stop in progress (the restart or reconfiguration already deals
    with the lost hardware), so stops never chain."""
    stops, end = [], -math.inf
    for t in sorted(starts):
        if t >= end:
            end = t + length
            stops.append((t, end))
    return stops


def _covering(points: np.ndarray, intervals: list[tuple[float, float]]) -> np.ndarray:
    """How many [a, b) intervals cover each point (vectorised: two sorted searches)."""
    if not intervals:
        return np.zeros(len(points))
    starts = np.sort([a for a, _ in intervals])
    ends = np.sort([b for _, b in intervals])
    return (np.searchsorted(starts, points, side="right")
            - np.searchsorted(ends, points, side="right")).astype(float)


def _elastic(p: GoodputParams, outages: list[Outage], slices: list[int]
             ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """An elastic job on `slices`: useful slice-seconds, then per segment between `edges`
    whether it trains and how many of its slices are up."""
    members = set(slices)
    mine = [(a, b) for a, b, s in outages if s in members]
    pauses = _renewal([a for a, _ in mine], p.downscale_seconds)
    pauses += _renewal([b for _, b in mine if b < p.horizon_seconds], p.upscale_seconds)
    # Piecewise-constant number of slices up, integrated outside the (merged) pauses.
    edges = sorted({0.0, p.horizon_seconds, *[x for iv in mine for x in iv],
                    *[x for iv in pauses for x in iv]})
    edges = np.array([e for e in edges if 0.0 <= e <= p.horizon_seconds])
    mids = (edges[:-1] + edges[1:]) / 2
    down = _covering(mids, mine)
    paused = _covering(mids, pauses) > 0
    up = len(slices) - down
    training = ~paused & (up > 0)
    useful = float(np.sum(np.where(training, up, 0.0) * np.diff(edges)))
    return useful, edges, training, up


def simulate_goodput(p: GoodputParams, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    times, hit = _failures(p, rng)
    outages = _outages(p, times, hit)
    horizon, n_slices = p.horizon_seconds, p.num_slices
    allocated = n_slices * horizon

    stops = _renewal(times.tolist(), p.restart_seconds)
    dp = 1.0 - sum(min(b, horizon) - a for a, b in stops) / horizon

    dp_elastic = _elastic(p, outages, list(range(n_slices)))[0] / allocated

    groups = [list(range(m, n_slices, p.learners)) for m in range(p.learners)]
    # Per learner, on a common fine grid: is it training, and on how many slices.
    grid = np.linspace(0.0, horizon, 20_001)
    mids = (grid[:-1] + grid[1:]) / 2
    useful, training_on_grid, up_on_grid = 0.0, [], []
    for group in groups:
        u, edges, training, up = _elastic(p, outages, group)
        useful += u
        idx = np.clip(np.searchsorted(edges, mids, side="right") - 1, 0, len(training) - 1)
        training_on_grid.append(training[idx])
        up_on_grid.append(up[idx])
    training_count = np.sum(training_on_grid, axis=0)
    # Synchronous DiLoCo: the same elastic learners, but every sync waits for all of them, so
    # any learner's pause stalls everyone (the stall is spread over the run, as in DP).
    everyone = training_count == p.learners
    sync_useful = float(np.sum(everyone * np.sum(up_on_grid, axis=0))) * (horizon / len(mids))
    return {"data_parallel": dp, "data_parallel_elastic": dp_elastic,
            "synchronous_diloco": sync_useful / allocated,
            "decoupled": useful / allocated,
            "decoupled_uptime": float(np.mean(training_count >= p.min_quorum)),
            "failures": int(len(outages))}


def goodput_with_ci(p: GoodputParams, seeds: int = 5) -> dict[str, dict[str, float]]:
    """Mean and 95% confidence half-width over seeds for each figure."""
    runs = [simulate_goodput(p, seed) for seed in range(seeds)]
    out = {}
    for key in runs[0]:
        values = np.array([r[key] for r in runs], dtype=float)
        half = 1.96 * values.std(ddof=1) / math.sqrt(seeds) if seeds > 1 else 0.0
        out[key] = {"mean": float(values.mean()), "ci95": float(half)}
    return out
