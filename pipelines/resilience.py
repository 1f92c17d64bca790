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

import math

from diloco_core.config import ExperimentConfig
from diloco_core.fault_tape import FAULT_KINDS
from diloco_core.ledger import Ledger
from diloco_core.stored_merge import StoredMerge
from resources.store.artifact_store import ArtifactStore

OUTAGES = ("learner_kill", "learner_hang")
EVERY_LEARNER_DOWN = ("instance_restart",)  # the learner processes died with the instance


def resilience_report(store: ArtifactStore, cfg: ExperimentConfig, merges: list[StoredMerge],
                      ledger: Ledger) -> dict:
    names = cfg.learners.learner_names
    P = cfg.sync.num_fragments
    # Learners write their attempt records (and, in a chaos run, fired-fault records): the
    # fields read here are checked, and a record whose field is not what it should be does
    # not count (the ledger already refused malformed attempt records, with their reasons).
    attempts = {n: [_with_times(a) for a in store.attempt_records(n)] for n in names}
    fired = [_plain_fields(f) for f in store.fired_faults() if _sound_fault(f, names)]
    rejoins = []
    outages = [(fault, fault["learner"]) for fault in fired if fault.get("kind") in OUTAGES]
    outages += [(fault, name) for fault in fired if fault.get("kind") in EVERY_LEARNER_DOWN
                for name in names]
    for fault, name in outages:
        at = float(fault["time"])
        later = [a for a in attempts.get(name, []) if a.get("started_at", 0.0) > at]
        relaunched = min((a["started_at"] for a in later), default=None)
        back = next((m for m in merges if name in m.members
                     and relaunched is not None
                     and (m.published_at or 0.0) > relaunched), None)
        missed = [m for m in merges if at < (m.published_at or 0.0)
                  and (back is None or (m.published_at or 0.0) < (back.published_at or 0.0))]
        rejoins.append({
            "fault": fault["id"], "kind": fault["kind"], "learner": name, "at": at,
            "step": fault.get("step"), "relaunched_at": relaunched,
            "back_in_round": None if back is None else back.round,
            "rejoin_seconds": None if back is None else (back.published_at or at) - at,
            "rounds_missed": len(missed) if back is not None else None})
    stop = store.stop_requested() or {}
    starts = [a["started_at"] for recs in attempts.values() for a in recs
              if a.get("started_at")]
    capacity = 0.0
    if starts and stop.get("at"):
        span = float(stop["at"]) - min(starts)
        for recs in attempts.values():
            tokens = sum(a["ledger"]["processed"] for a in recs)
            seconds = sum(a.get("compute_seconds", 0.0) for a in recs)
            if seconds > 0:
                capacity += tokens / seconds * span
    merged_tokens = ledger.fates["merged"] / P
    counts: dict[str, int] = {}
    for fault in fired:
        counts[fault["kind"]] = counts.get(fault["kind"], 0) + 1
    return {"faults_fired": counts, "faults": fired, "rejoins": rejoins,
            "goodput": merged_tokens / capacity if capacity > 0 else None,
            "learner_capacity_tokens": capacity}


def _seconds(value) -> float | None:
    """A finite, non-negative number of seconds (a time or a duration), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _with_times(record: dict) -> dict:
    """The attempt record with `started_at` and `compute_seconds` kept only when they are
    times (absent otherwise, as in a record from before they existed)."""
    out = {k: v for k, v in record.items() if k not in ("started_at", "compute_seconds")}
    for key in ("started_at", "compute_seconds"):
        value = _seconds(record.get(key))
        if value is not None:
            out[key] = value
    return out


def _sound_fault(fault, names) -> bool:
    if not isinstance(fault, dict) or not isinstance(fault.get("id"), str):
        return False
    if fault.get("kind") not in FAULT_KINDS or _seconds(fault.get("time")) is None:
        return False
    return fault["kind"] not in OUTAGES or fault.get("learner") in names


# What the injectors record of a fired fault (`resources.chaos.faults`): the summary keeps these.
FIRED_FIELDS = ("id", "kind", "learner", "attempt", "step", "round", "phase", "time", "pid")


def _plain_fields(fault: dict) -> dict:
    """The fault record's known fields whose values are plain (a short string, an integer, a
    finite number): the summary is written as strict JSON, and carries nothing else."""
    def plain(v) -> bool:
        if isinstance(v, str):
            return len(v) <= 200
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    return {k: fault[k] for k in FIRED_FIELDS if k in fault and plain(fault[k])}
