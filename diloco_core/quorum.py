"""The quorum and adaptive grace-window policy, as a pure function of time and arrivals.

A round may merge once `min_quorum` (K) learners have offered. From the moment the K-th offer
arrives, an adaptive grace window admits stragglers for

    grace = clip(gamma * (tau * xi_step - xi_quorum - xi_sync), grace_min, grace_max)

(Eq. 3 of the paper), i.e. at most a share gamma of the slack that the tau overlapped steps leave
after reaching quorum and syncing, so a merged fragment still lands before any learner needs it.
The window closes early once every live learner has offered. Offers that arrive after the window
closed are late: they are not admitted, and the decision says so.
"""

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from diloco_core.config import SyncConfig


@dataclass(frozen=True)
class Estimates:
    """Running (EMA) estimates in seconds: one inner step, open-to-quorum time, sync time."""

    step_seconds: float
    quorum_seconds: float = 0.0
    sync_seconds: float = 0.0

    def observe(self, decay: float, *, step: float | None = None, quorum: float | None = None,
                sync: float | None = None) -> "Estimates":
        def ema(old: float, new: float | None) -> float:
            return old if new is None else decay * old + (1.0 - decay) * new

        return Estimates(ema(self.step_seconds, step), ema(self.quorum_seconds, quorum),
                         ema(self.sync_seconds, sync))


@dataclass(frozen=True)
class Decision:
    """What the syncer should do with an open round now, and why."""

    merge: bool
    members: tuple[str, ...]          # admitted learners, in arrival order (merge only)
    late: tuple[str, ...]             # offered after the grace window closed
    missing: tuple[str, ...]          # live learners that have not offered
    reason: str
    grace_seconds: float | None = None
    deadline: float | None = None     # when the grace window closes (if quorum reached)


def grace_window(estimates: Estimates, cfg: SyncConfig) -> float:
    """Length of the grace window in seconds (0 when gamma is 0)."""
    if cfg.grace_gamma == 0:
        return 0.0
    slack = (cfg.overlap_steps * estimates.step_seconds - estimates.quorum_seconds
             - estimates.sync_seconds)
    return min(max(cfg.grace_gamma * max(slack, 0.0), cfg.grace_min_seconds), cfg.grace_max_seconds)


def _names(names: Collection[str]) -> str:
    return ", ".join(names) if names else "none"


def decide(now: float, arrivals: Mapping[str, float], live: Collection[str],
           estimates: Estimates, cfg: SyncConfig) -> Decision:
    """Decide an open round at time `now` given offer arrival times (learner -> seconds)."""
    order = sorted(arrivals, key=lambda name: (arrivals[name], name))
    live_set = set(live)
    k = cfg.min_quorum
    if len(order) < k:
        missing = tuple(sorted(live_set - set(order)))
        if len(live_set | set(order)) < k:
            reason = (f"quorum unreachable for now: {len(order)}/{k} offers and only "
                      f"{len(live_set)} live learners; waiting for learners to come back")
        else:
            reason = f"waiting for quorum: {len(order)}/{k} offers (from {_names(order)})"
        return Decision(False, (), (), missing, reason)

    quorum_time = arrivals[order[k - 1]]
    grace = grace_window(estimates, cfg)
    deadline = quorum_time + grace
    on_time = tuple(n for n in order if arrivals[n] <= deadline)
    late = tuple(n for n in order if arrivals[n] > deadline)
    missing = tuple(sorted(live_set - set(order)))
    if not missing and not late:
        return Decision(True, on_time, (), (),
                        f"all {len(on_time)} live learners offered ({_names(on_time)})",
                        grace, deadline)
    if now >= deadline:
        reason = (f"grace window of {grace:.3g}s closed at t={deadline:.3f}s: admitted "
                  f"{_names(on_time)}; late {_names(late)}; not offered {_names(missing)}")
        return Decision(True, on_time, late, missing, reason, grace, deadline)
    return Decision(False, (), (), missing,
                    f"quorum reached ({len(order)}/{k}); grace window open until "
                    f"t={deadline:.3f}s for {_names(missing)}", grace, deadline)
