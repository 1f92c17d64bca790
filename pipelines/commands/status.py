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
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_from_mapping
from diloco_core.liveness import LIVE_STATUSES
from diloco_core.round_records import Heartbeat, RoundDecision
from pipelines.experiment_state import experiment_state
from pipelines.syncer.status import SyncerRow, syncer_line, syncer_status
from resources.store.artifact_store import ArtifactStore, active_experiment


def _decisions(store: ArtifactStore, open_round: int | None, beats: dict[str, Heartbeat],
               timeout: float, now: float, last_rounds: int) -> list[RoundDecision]:
    """The decisions `run_status` needs, oldest first, read newest first and only as far back
    as they answer: the last `last_rounds`, and for each relaunched live learner, whether a
    decision since its start admitted it (`learner_state`'s "rejoining"): found, or a decision
    from before its start reached. A month-long run has millions of rounds; reading every
    decision made `diloco status` slower with every round."""
    asking = {n: b.started_at or 0.0 for n, b in beats.items()
              if b.attempt > 0 and b.status in LIVE_STATUSES and now - b.time <= timeout}
    found: list[RoundDecision] = []
    for r in range(-1 if open_round is None else open_round, -1, -1):
        if len(found) >= last_rounds and not asking:
            break
        d = store.get_decision(r)
        if d is None:
            continue
        found.append(d)
        asking = {n: start for n, start in asking.items()
                  if d.decided_at >= start and n not in d.members}
    return found[::-1]


def learner_state(beat: Heartbeat | None, decisions: list[RoundDecision], name: str,
                  timeout: float, now: float, absent: bool = False) -> str:
    """`absent`: the capacity record says the learner has no compute now (standby, or asked
    to leave)."""
    if beat is None:
        return "standby" if absent else "not started"
    status = beat.status
    if status == "done":
        return "done"
    if status in ("left", "leaving"):
        return status if absent else "joining"   # present again: its next attempt comes
    if absent:
        return "leaving"    # asked to; it reads the request at its next poll
    if status not in LIVE_STATUSES or now - beat.time > timeout:
        return "down"
    since = [d for d in decisions if d.decided_at >= (beat.started_at or 0.0)]
    if beat.attempt > 0 and not any(name in d.members for d in since):
        return "rejoining"
    if decisions and name in decisions[-1].late + decisions[-1].missing:
        return "late"
    return "live"


@dataclass(frozen=True)
class LearnerRow:
    learner: str
    region: str
    state: str
    attempt: int | None = None
    step: int | None = None
    tokens: int | None = None
    loss: float | None = None
    heartbeat_age_s: float | None = None
    versions: tuple[int, ...] | None = None
    offers: int | None = None


@dataclass(frozen=True)
class RunStatus:
    """Everything `diloco status` shows."""

    experiment: str
    state: str
    open_round: int | None
    rounds_merged: int
    global_versions: list[int | None]
    stop_requested: bool
    syncer: SyncerRow
    learners: list[LearnerRow]
    decisions: list[RoundDecision]     # the last few

    def to_json(self) -> dict:
        """As `diloco status --json` prints it: the decisions' who, why and grace only."""
        return {**asdict(self), "decisions": [
            {"round": d.round, "fragment": d.fragment, "members": list(d.members),
             "late": list(d.late), "missing": list(d.missing),
             "grace_seconds": d.grace_seconds, "reason": d.reason} for d in self.decisions]}


def run_status(store: ArtifactStore, now: float | None = None,
               last_rounds: int = 5) -> RunStatus:
    """Everything `diloco status` shows, read from the store."""
    now = time.time() if now is None else now
    cfg: ExperimentConfig = config_from_mapping(store.get_config())
    latest = store.latest_open_round()
    open_round = None if latest is None else latest.round
    beats = {n: b for n in cfg.learners.learner_names
             if (b := store.get_heartbeat(n)) is not None}
    decisions = _decisions(store, open_round, beats,
                           cfg.orchestration.learner_timeout_seconds, now, max(1, last_rounds))
    capacity, _ = store.capacity(cfg.learners.standby_names)
    learners = []
    for name, region in zip(cfg.learners.learner_names, cfg.learners.learner_regions,
                            strict=True):
        beat = beats.get(name)
        state = learner_state(beat, decisions, name,
                              cfg.orchestration.learner_timeout_seconds, now,
                              absent=name in capacity.absent)
        learners.append(LearnerRow(name, region, state) if beat is None else LearnerRow(
            name, region, state, attempt=beat.attempt, step=beat.step,
            tokens=beat.tokens_total, loss=beat.loss,
            heartbeat_age_s=round(now - beat.time, 1), versions=beat.versions,
            offers=beat.offers))
    versions = [store.current_version(p) for p in range(cfg.sync.num_fragments)]
    return RunStatus(
        experiment=store.experiment,
        state=experiment_state(store, active_experiment(store.blobs)),
        # Each merged round commits one version of its fragment.
        open_round=open_round, rounds_merged=sum(v or 0 for v in versions),
        global_versions=versions,
        stop_requested=store.stop_requested() is not None,
        syncer=syncer_status(store, cfg, decisions, now), learners=learners,
        decisions=decisions[-last_rounds:])


def print_status(status: RunStatus, console: Console | None = None) -> None:
    console = console or Console()
    # A finished run has no open round: its last one was the final round, decided and merged.
    at = status.open_round
    where = {
        "active": f"round {at} open",
        "stopping": f"round {at} open (stopping: finishing the final rounds)",
        "finished": f"finished after round {at}",
        "stopped": f"stopped early at an operator's request after round {at}",
        "inactive": f"inactive at round {at} (its processes are not running; "
                    "launching it again resumes it)",
    }[status.state]
    console.print(f"[bold]{status.experiment}[/]: {status.rounds_merged} rounds merged, "
                  f"{where}, global fragment versions {status.global_versions}")
    console.print(syncer_line(status.syncer))
    learners = Table(title="learners")
    for column in ("learner", "region", "state", "attempt", "step", "tokens", "loss",
                   "heartbeat"):
        learners.add_column(column, justify="right" if column in ("step", "tokens") else "left")
    colour = {"live": "green", "late": "yellow", "rejoining": "cyan", "down": "red"}
    for row in status.learners:
        loss = "" if row.loss is None else f"{row.loss:.3f}"
        age = "" if row.heartbeat_age_s is None else f"{row.heartbeat_age_s:.0f}s ago"
        learners.add_row(row.learner, row.region,
                         f"[{colour.get(row.state, 'white')}]{row.state}[/]",
                         str(row.attempt if row.attempt is not None else ""),
                         str(row.step or ""), f"{row.tokens or 0:,}", loss, age)
    console.print(learners)
    decisions = Table(title=f"last {len(status.decisions)} decisions")
    for column in ("round", "fragment", "admitted", "late", "grace", "reason"):
        decisions.add_column(column)
    for d in status.decisions:
        grace = "" if d.grace_seconds is None else f"{d.grace_seconds:.1f}s"
        decisions.add_row(str(d.round), str(d.fragment), ", ".join(d.members) or "-",
                          ", ".join(d.late) or "-", grace, d.reason)
    console.print(decisions)


def status_json(status: RunStatus) -> str:
    return json.dumps(status.to_json(), indent=2, default=str)
