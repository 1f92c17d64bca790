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

from diloco_core.config import ExperimentConfig
from diloco_core.ledger import Ledger
from resources.store.artifact_store import ArtifactStore

OUTAGES = ("learner_kill", "learner_hang")
EVERY_LEARNER_DOWN = ("instance_restart",)  # the learner processes died with the instance


def resilience_report(store: ArtifactStore, cfg: ExperimentConfig, merges: list[dict],
                      ledger: Ledger) -> dict:
    names = cfg.learners.learner_names
    P = cfg.sync.num_fragments
    attempts = {n: store.attempt_records(n) for n in names}
    fired = store.fired_faults()
    rejoins = []
    outages = [(fault, fault["learner"]) for fault in fired if fault.get("kind") in OUTAGES]
    outages += [(fault, name) for fault in fired if fault.get("kind") in EVERY_LEARNER_DOWN
                for name in names]
    for fault, name in outages:
        at = float(fault["time"])
        later = [a for a in attempts.get(name, []) if a.get("started_at", 0.0) > at]
        relaunched = min((a["started_at"] for a in later), default=None)
        back = next((m for m in merges if name in m.get("members", [])
                     and relaunched is not None
                     and (m.get("published_at") or 0.0) > relaunched), None)
        missed = [m for m in merges if at < (m.get("published_at") or 0.0)
                  and (back is None or m["published_at"] < back["published_at"])]
        rejoins.append({
            "fault": fault["id"], "kind": fault["kind"], "learner": name, "at": at,
            "step": fault.get("step"), "relaunched_at": relaunched,
            "back_in_round": None if back is None else back["round"],
            "rejoin_seconds": None if back is None else back["published_at"] - at,
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
