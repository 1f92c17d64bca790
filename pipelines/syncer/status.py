"""The syncer's line in `diloco status`: who holds its lease (the syncer or its warm standby,
which attempt), since when, how long ago it was renewed, and who decided the last round.

Read from the store alone (the lease record, `resources/store/lease.py`, and the decisions).
Ages compare the holder's wall clock with this machine's, as the learners' heartbeat ages do:
a skewed clock shifts them. The syncer and the sensors never compare clocks; they judge the
lease by when they saw it move.
"""

import time
from dataclasses import dataclass, replace

from diloco_core.config import ExperimentConfig
from diloco_core.round_records import RoundDecision
from resources.store.artifact_store import ArtifactStore


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(now - then, 1)


@dataclass(frozen=True)
class LastDecision:
    round: int
    decided_by: str
    age_s: float | None


@dataclass(frozen=True)
class SyncerRow:
    """`state`: `syncing` (renewed within `orchestration.syncer_timeout_seconds`), `silent`
    (not renewed for longer: dead or hung; the quorum sensor decides meanwhile), `released`
    (a clean exit), `none` (no syncer has taken the lease yet), or `sensor`
    (`orchestration.syncer=sensor`: the quorum sensor decides every round)."""

    state: str
    last_decision: LastDecision | None = None
    holder: str | None = None
    attempt: int | None = None
    standby: bool | None = None
    epoch: int | None = None
    since: float | None = None
    held_for_s: float | None = None
    renewed_age_s: float | None = None


def syncer_status(store: ArtifactStore, cfg: ExperimentConfig,
                  decisions: list[RoundDecision], now: float) -> SyncerRow:
    """Who holds the syncer's lease and how it stands (`SyncerRow`)."""
    last = decisions[-1] if decisions else None
    row = SyncerRow("sensor", None if last is None else LastDecision(
        last.round, last.decided_by, _age(now, last.decided_at)))
    if cfg.orchestration.syncer != "service":
        return row
    lease = store.get_syncer_lease()
    if lease is None:
        return replace(row, state="none")
    renewed = _age(now, lease.time)
    if lease.status == "released":
        state = "released"
    elif renewed is not None and renewed > cfg.orchestration.syncer_timeout_seconds:
        state = "silent"
    else:
        state = "syncing"
    return replace(row, state=state, holder=lease.holder_name, attempt=lease.attempt,
                   standby=lease.standby, epoch=lease.epoch, since=lease.since,
                   held_for_s=_age(now, lease.since), renewed_age_s=renewed)


def _seconds(value: float | None) -> str:
    if value is None:
        return "?"
    value = max(value, 0.0)
    return f"{value:.1f}s" if value < 60 else f"{value // 60:.0f}m{value % 60:02.0f}s"


def syncer_line(row: SyncerRow) -> str:
    """One line (rich markup) for the status table's header."""
    last = row.last_decision
    decided = "" if last is None else (
        f"; last decision: round {last.round} by {last.decided_by}, "
        f"{_seconds(last.age_s)} ago")
    state = row.state
    if state == "sensor":
        return f"syncer: none (orchestration.syncer=sensor: the quorum sensor decides){decided}"
    if state == "none":
        return f"syncer: [yellow]no lease taken yet[/] (starting){decided}"
    who = f"{row.holder} (attempt {row.attempt}" + (
        ", the warm standby" if row.standby else "") + ")"
    if state == "released":
        return (f"syncer: {who} released the lease {_seconds(row.renewed_age_s)} ago"
                f"{decided}")
    colour = "green" if state == "syncing" else "red"
    held = "" if row.since is None else (
        f" since {time.strftime('%H:%M:%S', time.localtime(row.since))} "
        f"({_seconds(row.held_for_s)})")
    silent = " (dead or hung: the quorum sensor decides meanwhile)" if state == "silent" else ""
    return (f"syncer: [{colour}]{state}[/], {who} has held the lease{held}, renewed "
            f"{_seconds(row.renewed_age_s)} ago{silent}{decided}")
