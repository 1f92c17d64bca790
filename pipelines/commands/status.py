"""`diloco status`: where a training run stands, read from the store alone.

It needs no Dagster instance, only the store (a directory or `gs://…`), so it works from any
machine that can read the bucket: the rounds, the syncer (who holds its lease, since when,
last renewal; `pipelines/syncer/status.py`), every learner's state, and the last merge
decisions with their reasons.

A learner is
- `live`: its heartbeat is recent and it was admitted to the last merge it could be;
- `late`: live, but the last merge went ahead without its offer (it arrived after the grace
  window, or not at all);
- `rejoining`: relaunched (attempt > 0) and not yet admitted to a merge since it restarted;
- `down`: no heartbeat for `orchestration.learner_timeout_seconds`, or its process failed;
- `done` / `not started`.
Heartbeat ages use the learner's own clock against this machine's, so a skewed clock shifts
them; the syncer itself never compares clocks (`diloco_core/liveness.py`).
"""

import json
import time

from rich.console import Console
from rich.table import Table

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_from_mapping
from diloco_core.liveness import LIVE_STATUSES
from pipelines.experiment_state import experiment_state
from pipelines.syncer.status import syncer_line, syncer_status
from resources.store.artifact_store import ArtifactStore, active_experiment


def _decisions(store: ArtifactStore, open_round: int | None) -> list[dict]:
    last = -1 if open_round is None else open_round
    return [d for r in range(last + 1) if (d := store.get_decision(r)) is not None]


def learner_state(beat: dict | None, decisions: list[dict], name: str, timeout: float,
                  now: float, absent: bool = False) -> str:
    """`absent`: the capacity record says the learner has no compute now (standby, or asked
    to leave)."""
    if beat is None:
        return "standby" if absent else "not started"
    status = beat.get("status")
    if status == "done":
        return "done"
    if status in ("left", "leaving"):
        return status if absent else "joining"   # present again: its next attempt comes
    if absent:
        return "leaving"    # asked to; it reads the request at its next poll
    if status not in LIVE_STATUSES or now - float(beat.get("time", 0.0)) > timeout:
        return "down"
    since = [d for d in decisions if d.get("decided_at", 0.0) >= beat.get("started_at", 0.0)]
    if int(beat.get("attempt", 0)) > 0 and not any(name in d["members"] for d in since):
        return "rejoining"
    if decisions and name in (decisions[-1].get("late") or []) + (decisions[-1].get("missing")
                                                                  or []):
        return "late"
    return "live"


def run_status(store: ArtifactStore, now: float | None = None, last_rounds: int = 5) -> dict:
    """Everything `diloco status` shows, as plain data."""
    now = time.time() if now is None else now
    cfg: ExperimentConfig = config_from_mapping(store.get_config())
    open_round = (store.latest_open_round() or {}).get("round")
    decisions = _decisions(store, open_round)
    capacity, _ = store.capacity(cfg.learners.standby_names)
    learners = []
    for name, region in zip(cfg.learners.learner_names, cfg.learners.learner_regions,
                            strict=True):
        beat = store.get_heartbeat(name)
        state = learner_state(beat, decisions, name,
                              cfg.orchestration.learner_timeout_seconds, now,
                              absent=name in capacity.absent)
        beat = beat or {}
        learners.append({
            "learner": name, "region": region, "state": state,
            "attempt": beat.get("attempt"), "step": beat.get("step"),
            "tokens": beat.get("tokens_total"), "loss": beat.get("loss"),
            "heartbeat_age_s": None if "time" not in beat else round(now - beat["time"], 1),
            "versions": beat.get("versions"), "offers": beat.get("offers")})
    merged = [d for d in decisions if d["members"]]
    return {
        "experiment": store.experiment,
        "state": experiment_state(store, active_experiment(store.blobs)),
        "open_round": open_round,
        "rounds_merged": len(merged),
        "global_versions": [store.current_version(p) for p in range(cfg.sync.num_fragments)],
        "stop_requested": store.stop_requested() is not None,
        "syncer": syncer_status(store, cfg, decisions, now),
        "learners": learners,
        "decisions": [{k: d.get(k) for k in ("round", "fragment", "members", "late",
                                              "missing", "grace_seconds", "reason")}
                      for d in decisions[-last_rounds:]],
    }


def print_status(status: dict, console: Console | None = None) -> None:
    console = console or Console()
    # A finished run has no open round: its last one was the final round, decided and merged.
    where = {
        "active": f"round {status['open_round']} open",
        "stopping": f"round {status['open_round']} open (stopping: finishing the final rounds)",
        "finished": f"finished after round {status['open_round']}",
        "stopped": f"stopped early at an operator's request after round {status['open_round']}",
        "inactive": f"inactive at round {status['open_round']} (its processes are not running; "
                    "launching it again resumes it)",
    }[status.get("state", "active")]
    console.print(f"[bold]{status['experiment']}[/]: {status['rounds_merged']} rounds merged, "
                  f"{where}, global fragment versions {status['global_versions']}")
    if status.get("syncer") is not None:
        console.print(syncer_line(status["syncer"]))
    learners = Table(title="learners")
    for column in ("learner", "region", "state", "attempt", "step", "tokens", "loss",
                   "heartbeat"):
        learners.add_column(column, justify="right" if column in ("step", "tokens") else "left")
    colour = {"live": "green", "late": "yellow", "rejoining": "cyan", "down": "red"}
    for row in status["learners"]:
        state = row["state"]
        loss = "" if row["loss"] is None else f"{row['loss']:.3f}"
        age = "" if row["heartbeat_age_s"] is None else f"{row['heartbeat_age_s']:.0f}s ago"
        learners.add_row(row["learner"], row["region"],
                         f"[{colour.get(state, 'white')}]{state}[/]",
                         str(row["attempt"] if row["attempt"] is not None else ""),
                         str(row["step"] or ""), f"{row['tokens'] or 0:,}", loss, age)
    console.print(learners)
    decisions = Table(title=f"last {len(status['decisions'])} decisions")
    for column in ("round", "fragment", "admitted", "late", "grace", "reason"):
        decisions.add_column(column)
    for d in status["decisions"]:
        grace = "" if d["grace_seconds"] is None else f"{d['grace_seconds']:.1f}s"
        decisions.add_row(str(d["round"]), str(d["fragment"]), ", ".join(d["members"]) or "-",
                          ", ".join(d["late"] or []) or "-", grace, d["reason"] or "")
    console.print(decisions)


def status_json(status: dict) -> str:
    return json.dumps(status, indent=2, default=str)
