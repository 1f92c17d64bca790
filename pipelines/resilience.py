"""Resilience figures of a run, from the store: faults fired, rejoins, goodput.

- rejoins: for every injected learner kill or hang (and for every learner after an instance
  restart, which kills them all), when the learner was relaunched and when a
  merge next included it (`rejoin_seconds`), and how many merges were committed without it in
  between (`rounds_missed`).
- goodput: tokens merged / tokens the allocated learners could have processed between the
  first learner start and STOP (each learner at its own measured rate: tokens per second of
  inner-step compute, so slow hardware is not counted as lost). Lost work (dead, late,
  rejected, superseded) and time a learner was down both lower it.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from diloco_core.config import ExperimentConfig
from diloco_core.fault_tape import FAULT_KINDS
from diloco_core.ledger import Ledger
from diloco_core.round_records import finite_float
from diloco_core.stored_merge import StoredMerge
from resources.store.artifact_store import ArtifactStore
from resources.store.summary_records import FiredFault, Rejoin, Resilience

OUTAGES = ("learner_kill", "learner_hang")
EVERY_LEARNER_DOWN = ("instance_restart",)  # the learner processes died with the instance


@dataclass(frozen=True)
class AttemptTimes:
    """What the goodput and rejoin figures take from a learner's attempt record (which the
    learner writes): when the process started and its inner-step compute, None unless they
    are times, and the tokens it processed (the ledger has checked that count)."""
    started_at: float | None
    compute_seconds: float | None
    processed: int

    @classmethod
    def of(cls, record: dict) -> "AttemptTimes":
        return cls(started_at=_seconds(record.get("started_at")),
                   compute_seconds=_seconds(record.get("compute_seconds")),
                   processed=record["ledger"]["processed"])


def resilience_report(store: ArtifactStore, cfg: ExperimentConfig, merges: list[StoredMerge],
                      ledger: Ledger) -> Resilience:
    names = cfg.learners.learner_names
    P = cfg.sync.num_fragments
    # Learners write their attempt records (and, in a chaos run, fired-fault records): the
    # fields read here are checked, and a record whose field is not what it should be does
    # not count (the ledger already refused malformed attempt records, with their reasons).
    attempts = {n: [AttemptTimes.of(a) for a in store.attempt_records(n)] for n in names}
    fired = [f for raw in store.fired_faults() if (f := fired_fault(raw, names)) is not None]
    rejoins = []
    outages = [(fault, fault.learner) for fault in fired if fault.kind in OUTAGES]
    outages += [(fault, name) for fault in fired if fault.kind in EVERY_LEARNER_DOWN
                for name in names]
    for fault, name in outages:
        at = fault.time
        relaunched = min((a.started_at for a in attempts.get(name, [])
                          if a.started_at is not None and a.started_at > at), default=None)
        back = next((m for m in merges if name in m.members
                     and relaunched is not None
                     and (m.published_at or 0.0) > relaunched), None)
        missed = [m for m in merges if at < (m.published_at or 0.0)
                  and (back is None or (m.published_at or 0.0) < (back.published_at or 0.0))]
        rejoins.append(Rejoin(
            fault=fault.id, kind=fault.kind, learner=name, at=at, step=fault.step,
            relaunched_at=relaunched, back_in_round=None if back is None else back.round,
            rejoin_seconds=None if back is None else (back.published_at or at) - at,
            rounds_missed=len(missed) if back is not None else None))
    stop = store.stop_requested() or {}
    starts = [a.started_at for recs in attempts.values() for a in recs if a.started_at]
    capacity = 0.0
    stopped_at = _seconds(stop.get("at"))
    if starts and stopped_at:
        span = stopped_at - min(starts)
        for recs in attempts.values():
            tokens = sum(a.processed for a in recs)
            seconds = sum(a.compute_seconds or 0.0 for a in recs)
            if seconds > 0:
                capacity += tokens / seconds * span
    merged_tokens = ledger.fates["merged"] / P
    counts: dict[str, int] = {}
    for fault in fired:
        counts[fault.kind] = counts.get(fault.kind, 0) + 1
    return Resilience(faults_fired=counts, faults=tuple(fired), rejoins=tuple(rejoins),
                      goodput=merged_tokens / capacity if capacity > 0 else None,
                      learner_capacity_tokens=capacity)


def _seconds(value) -> float | None:
    """A finite, non-negative number of seconds (a time or a duration), or None."""
    seconds = finite_float(value)
    return seconds if seconds is not None and seconds >= 0 else None


def fired_fault(raw: Any, names: Sequence[str]) -> FiredFault | None:
    """The fired-fault record as a `FiredFault`, or None if it is not one: a field of the
    wrong type, an unknown kind, or an outage of a learner not on the roster."""
    try:
        fault = FiredFault.model_validate(raw)
    except pydantic.ValidationError:
        return None
    if fault.kind not in FAULT_KINDS:
        return None
    return fault if fault.kind not in OUTAGES or fault.learner in names else None
