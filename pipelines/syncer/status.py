"""The syncer's line in `diloco status`: who holds its lease (the syncer or its warm standby,
which attempt), since when, how long ago it was renewed, and who decided the last round.

Read from the store alone (the lease record, `resources/store/lease.py`, and the decisions).
Ages compare the holder's wall clock with this machine's, as the learners' heartbeat ages do:
a skewed clock shifts them. The syncer and the sensors never compare clocks; they judge the
lease by when they saw it move.
"""

import time

from diloco_core.config import ExperimentConfig
from resources.store.artifact_store import ArtifactStore
from resources.store.lease import LeaseView


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(now - then, 1)


def syncer_status(store: ArtifactStore, cfg: ExperimentConfig, decisions: list[dict],
                  now: float) -> dict:
    """As plain data. `state`: `syncing` (renewed within `orchestration.syncer_timeout_seconds`),
    `silent` (not renewed for longer: dead or hung; the quorum sensor decides meanwhile),
    `released` (a clean exit), `none` (no syncer has taken the lease yet), or `sensor`
    (`orchestration.syncer=sensor`: the quorum sensor decides every round)."""
    last = decisions[-1] if decisions else None
    row = {"state": "sensor", "holder": None, "attempt": None, "standby": None, "epoch": None,
           "since": None, "held_for_s": None, "renewed_age_s": None,
           "last_decision": None if last is None else {
               "round": last.get("round"), "decided_by": last.get("decided_by"),
               "age_s": _age(now, last.get("decided_at"))}}
    if cfg.orchestration.syncer != "service":
        return row
    lease = LeaseView.of(store.get_syncer_lease())
    if lease is None:
        return {**row, "state": "none"}
    renewed = _age(now, lease.renewed_at)
    if lease.status == "released":
        state = "released"
    elif renewed is not None and renewed > cfg.orchestration.syncer_timeout_seconds:
        state = "silent"
    else:
        state = "syncing"
    return {**row, "state": state, "holder": lease.name, "attempt": lease.attempt,
            "standby": lease.standby, "epoch": lease.epoch, "since": lease.since,
            "held_for_s": _age(now, lease.since), "renewed_age_s": renewed}


def _seconds(value: float | None) -> str:
    if value is None:
        return "?"
    value = max(value, 0.0)
    return f"{value:.1f}s" if value < 60 else f"{value // 60:.0f}m{value % 60:02.0f}s"


def syncer_line(row: dict) -> str:
    """One line (rich markup) for the status table's header."""
    last = row["last_decision"]
    decided = "" if last is None else (
        f"; last decision: round {last['round']} by {last['decided_by']}, "
        f"{_seconds(last['age_s'])} ago")
    state = row["state"]
    if state == "sensor":
        return f"syncer: none (orchestration.syncer=sensor: the quorum sensor decides){decided}"
    if state == "none":
        return f"syncer: [yellow]no lease taken yet[/] (starting){decided}"
    who = f"{row['holder']} (attempt {row['attempt']}" + (
        ", the warm standby" if row["standby"] else "") + ")"
    if state == "released":
        return (f"syncer: {who} released the lease {_seconds(row['renewed_age_s'])} ago"
                f"{decided}")
    colour = "green" if state == "syncing" else "red"
    held = "" if row["since"] is None else (
        f" since {time.strftime('%H:%M:%S', time.localtime(row['since']))} "
        f"({_seconds(row['held_for_s'])})")
    silent = " (dead or hung: the quorum sensor decides meanwhile)" if state == "silent" else ""
    return (f"syncer: [{colour}]{state}[/], {who} has held the lease{held}, renewed "
            f"{_seconds(row['renewed_age_s'])} ago{silent}{decided}")
