"""The summary of an orchestrated run, computed from the store alone.

- rounds_merged: rounds whose merge committed a new fragment version.
- uptime: share of the time between the first and the last merge in which merges kept
  advancing. A gap between two consecutive merges longer than twice the median gap counts as
  down for its excess (a stall); steady merging is uptime 1.
- learner_idle_fraction: over all learners' last attempts, time in the training loop not spent
  in inner steps (applying merges, encoding offers, checkpointing, heartbeats) / loop time.
- merge_latency_seconds: quorum reached -> merged version published (the grace window, the
  decision and the merge); decision_to_publish_seconds: the merge alone (decision record
  written -> published). Both median and p90 over the run's merges. `published_at` is taken
  as the merged version's objects are about to be written (a few ms on a local disk).
- merged_by / decided_by: how many merges and decisions the syncer service (per attempt),
  the sensor fallback and its merge runs made.
- learners_rejoined: learners relaunched at least once whose contributions were merged after
  the relaunch.
- ledger: where every processed token went (`pipelines.token_ledger`); faults, rejoins and
  goodput (`pipelines.resilience`).
- evals: the initial (every fragment at version 0) and final held-out evals the losses come
  from, with the versions and batches they saw. An eval passed in (the syncer's own, made with
  its warm eval program) is used only if it saw exactly those versions and batches.

Who writes it: the syncer service, as soon as the final rounds are merged and every learner's
last process has ended (its ledger records are final then); the `summarize` run the quorum
sensor requests then records it as the `run_summary` asset, reusing those evals.
"""

import dataclasses
import statistics
from collections.abc import Iterable

from diloco_core.config_loading import config_from_mapping
from diloco_core.liveness import ENDED_STATUSES
from diloco_core.round_records import RoundDecision
from diloco_core.stored_merge import StoredMerge
from pipelines.resilience import resilience_report
from pipelines.round_eval import evaluate_global
from pipelines.token_ledger import run_ledger
from resources.store.artifact_store import ArtifactStore
from resources.store.summary_records import (
    CapacityReport,
    Distribution,
    Evals,
    HeldoutEval,
    LearnerAccount,
    LedgerReport,
    RoundEntry,
    RunOutcome,
    RunSummary,
    RunTiming,
)


def merge_records(store: ArtifactStore, num_fragments: int) -> list[StoredMerge]:
    """Every committed merge (fragment version > 0), oldest first, with its metadata."""
    records = []
    for p in range(num_fragments):
        for version in store.versions(p):
            if version > 0:
                meta = store.version_meta(p, version)
                records.append(StoredMerge(fragment=p) if meta is None
                               else dataclasses.replace(meta, fragment=p))
    return sorted(records, key=lambda m: m.published_at or 0.0)


def uptime(publish_times: list[float], median_gap: float | None = None) -> float:
    """`median_gap`: the steady gap between merges to measure stalls against (default: this
    run's own median; the chaos soak passes its fault-free run's)."""
    if len(publish_times) < 3:
        return 1.0
    gaps = [b - a for a, b in zip(publish_times, publish_times[1:], strict=False)]
    allowed = 2.0 * (statistics.median(gaps) if median_gap is None else median_gap)
    span = publish_times[-1] - publish_times[0]
    down = sum(max(0.0, g - allowed) for g in gaps)
    return 1.0 - down / span if span > 0 else 1.0


def learners_ended(store: ArtifactStore, cfg) -> bool:
    """Every learner on the roster has ended its last process (its final heartbeat says so) or
    never started one (standby): the summary's ledger and token counts are final. A learner
    that died without saying so is the caller's timeout to bound: a learner's own clock is
    never compared with the reader's."""
    for name in cfg.learners.learner_names:
        beat = store.get_heartbeat(name)
        if beat is not None and beat.status not in ENDED_STATUSES:
            return False
    return True


def _eval(store: ArtifactStore, given: HeldoutEval | None, batches: int, num_fragments: int,
          version: int | None) -> HeldoutEval:
    """`given` if it evaluated exactly these fragment versions on these batches, else a fresh
    evaluation (a JAX program to compile in a fresh process: seconds)."""
    expected = ((0,) * num_fragments if version == 0
                else tuple(store.current_version(p) for p in range(num_fragments)))
    if given is not None and given.versions == expected and given.batches == batches:
        return given
    return evaluate_global(store, batches, version=version)


def _round_entry(store: ArtifactStore, r: int, decision: RoundDecision,
                 merge: StoredMerge | None) -> RoundEntry:
    """The decided round `r`: its decision, and its merge (who merged it and how long it took:
    a latency percentile is only explained by the rounds behind it, e.g. merge runs while no
    syncer held a lease) or why nothing was committed."""
    # A round that committed nothing may still have refused contributions (all of them).
    not_merged = store.get_round_not_merged(r) if merge is None else None
    record = merge or not_merged
    return RoundEntry(
        round=r, fragment=decision.fragment, decided_by=decision.decided_by,
        admitted=decision.members, late=decision.late, missing=decision.missing,
        final=decision.final, decided_at=decision.decided_at, reason=decision.reason,
        merged=merge is not None,
        not_merged_reason=None if not_merged is None else not_merged.reason,
        rejected={} if record is None else dict(record.rejected),
        published_at=None if merge is None else merge.published_at,
        merged_by=None if merge is None else merge.merged_by,
        quorum_to_publish_seconds=None if merge is None else merge.latency(decision.quorum_at),
        decision_to_publish_seconds=(None if merge is None
                                     else merge.latency(decision.decided_at)))


def build_summary(store: ArtifactStore, eval_batches: int | None = None,
                  evals: Evals | None = None) -> RunSummary:
    """The run's summary; `evals` (the syncer's own) are reused where they saw the right
    versions and batches."""
    cfg = config_from_mapping(store.get_config())
    names = cfg.learners.learner_names
    merges = merge_records(store, cfg.sync.num_fragments)
    latest = store.latest_open_round()
    last_round = -1 if latest is None else latest.round
    merged_rounds = {m.round: m for m in merges}
    rounds = [_round_entry(store, r, decision, merged_rounds.get(r))
              for r in range(last_round + 1)
              if (decision := store.get_decision(r)) is not None]
    beats = {n: b for n in names if (b := store.get_heartbeat(n)) is not None}
    training = sum(b.training_seconds for b in beats.values())
    compute = sum(b.compute_seconds for b in beats.values())
    rejoined = [n for n, b in beats.items() if b.attempt > 0 and any(
        n in m.members and (m.published_at or 0) > (b.started_at or 0.0) for m in merges)]
    ledger, rejections = run_ledger(store, cfg)
    batches = eval_batches or cfg.orchestration.eval_batches
    evals = evals or Evals()
    initial = _eval(store, evals.initial, batches, cfg.sync.num_fragments, version=0)
    final = _eval(store, evals.final, batches, cfg.sync.num_fragments, version=None)
    publish = [m.published_at for m in merges if m.published_at]
    return RunSummary(
        outcome=RunOutcome(
            experiment=store.experiment, rounds_opened=last_round + 1,
            rounds_merged=len(merges), initial_eval_loss=initial.loss,
            final_eval_loss=final.loss, final_bits_per_byte=final.bits_per_byte,
            final_sample=final.sample, tokens=sum(b.tokens_total for b in beats.values()),
            token_budget=store.token_budget(cfg.token_budget)),   # raised on resume, if it was
        timing=RunTiming(
            uptime=uptime(publish),
            merge_latency_seconds=_distribution(
                [r.quorum_to_publish_seconds for r in rounds
                 if r.quorum_to_publish_seconds is not None]),
            decision_to_publish_seconds=_distribution(
                [r.decision_to_publish_seconds for r in rounds
                 if r.decision_to_publish_seconds is not None]),
            merged_by=_counts(m.merged_by for m in merges),
            decided_by=_counts(r.decided_by or "sensor" for r in rounds)),
        learners=LearnerAccount(
            learner_idle_fraction=(training - compute) / training if training > 0 else 0.0,
            learners_rejoined=tuple(sorted(rejoined)),
            learner_attempts={n: (beats[n].attempt + 1 if n in beats else 1) for n in names},
            learner_restarted_at={n: b.started_at for n, b in beats.items() if b.attempt > 0},
            learner_status={n: (beats[n].status if n in beats else None) for n in names},
            # Where each learner's latest process took its state from (own checkpoint, a
            # peer's AdamW state and the global parameters, or fresh).
            learner_started_from={n: (beats[n].rejoined_from if n in beats else None)
                                  for n in names},
            bytes_up=sum(b.bytes_up for b in beats.values())),
        resilience=resilience_report(store, cfg, merges, ledger),
        ledger=LedgerReport(**ledger.summary(), rejections=rejections),
        # Scavenged capacity: who was absent at the end, and every join and leave in order.
        capacity=CapacityReport.model_validate(
            store.capacity(cfg.learners.standby_names)[0].to_json()),
        evals=Evals(initial=initial, final=final),
        rounds=tuple(rounds))


def latency_by_merger(rounds: Iterable[RoundEntry], field: str) -> dict[str, Distribution]:
    """A latency's distribution per merger kind ("syncer": the service, "run": the sensor's
    fallback merge runs), from the per-round summary entries (`field`: one of RoundEntry's
    latencies)."""
    kinds: dict[str, list[float]] = {}
    for r in rounds:
        value = getattr(r, field)
        if value is not None:
            kind = "syncer" if (r.merged_by or "").startswith("syncer") else "run"
            kinds.setdefault(kind, []).append(value)
    return {kind: _distribution(values) for kind, values in sorted(kinds.items())}


def _distribution(values: list[float]) -> Distribution:
    return Distribution(
        median=statistics.median(values) if values else None,
        p90=statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else None,
        count=len(values))


def _counts(names) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in names:
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))
