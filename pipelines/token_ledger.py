"""The token ledger of a run, assembled from the store (see `diloco_core.ledger`).

Learner processes write their own ledgers (`learners/{l}/attempts/`); offers carry their claim
and the process that made them; decisions and committed merges give each offer its fate.
"""

from collections.abc import Sequence
from typing import Any

from diloco_core.config import ExperimentConfig
from diloco_core.ledger import MAX_ATTEMPT, Ledger, build_ledger, ledger_count
from diloco_core.round_records import MAX_INT
from resources.store import layout
from resources.store.artifact_store import ArtifactStore, RejectedArtifact


def offer_claim(extra: Any) -> tuple[dict | None, str | None]:
    """The {attempt, claim} an offer's manifest carries in its `extra` (free-form JSON that the
    learner writes), checked field by field: (the offer, None) or (None, why it is refused).
    An offer from before the ledger existed has neither field: attempt 0, no claim."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        return None, f"extra must be an object, got {type(extra).__name__}"
    attempt, claim = extra.get("attempt", 0), extra.get("claim")
    if not ledger_count(attempt, MAX_ATTEMPT):
        return None, f"extra.attempt must be an integer in [0, {MAX_ATTEMPT}], got " \
                     f"{str(attempt)[:40]}"
    if claim is not None and not ledger_count(claim, MAX_INT):
        return None, f"extra.claim must be an integer in [0, {MAX_INT}], got {str(claim)[:40]}"
    return {"attempt": attempt, "claim": claim}, None


def offer_fates(store: ArtifactStore, num_fragments: int, learners: Sequence[str],
                refusals: list[dict] | None = None) -> tuple[dict, dict, list[dict]]:
    """(round, learner) -> stored offer {attempt, claim}; (round, learner) -> fate; and the
    rejections with their reasons. Only the experiment's learners count: anything else under
    a round's contributions (a foreign or hostile writer) was never merged, and is not read.
    An offer whose manifest cannot be read, or whose attempt or claim is malformed, is left
    out (its claim counts as `offer_not_stored`), and appended to `refusals` ({"key",
    "reason"}) when given."""
    merged = {}
    for p in range(num_fragments):
        for version in store.versions(p):
            meta = store.version_meta(p, version) if version > 0 else None
            if meta is not None and meta.round is not None:
                merged[meta.round] = meta
    offers, fates, rejections = {}, {}, []
    latest = store.latest_open_round()
    last_round = -1 if latest is None else latest.round
    for r in range(last_round + 1):
        decision = store.get_decision(r)
        merge = merged.get(r)
        not_merged = (store.get_round_not_merged(r)
                      if merge is None and decision is not None else None)
        refused = {} if not_merged is None else not_merged.rejected
        for learner in store.list_contributions(r):
            if learner not in learners:
                continue
            key = f"{layout.contribution_dir(store.experiment, r, learner)}/{layout.MANIFEST}"
            try:
                manifest = store.contribution_manifest(r, learner)
            except RejectedArtifact as err:  # the learner's claim counts as offer_not_stored
                if refusals is not None:
                    refusals.append({"key": key, "reason": err.reason})
                continue
            offer, why = offer_claim(None if manifest is None else manifest.extra)
            if offer is None:
                if refusals is not None:
                    refusals.append({"key": key, "reason": why})
                continue
            offers[(r, learner)] = offer
            if decision is None:
                fate = "undecided"
            elif learner not in decision.members:
                fate = "late"
            elif learner in refused:
                fate = "rejected"   # refused, and so was everyone else: nothing committed
                rejections.append({"round": r, "learner": learner, "reason": refused[learner]})
            elif merge is None:
                fate = "round_not_merged"
            elif learner in merge.members:
                fate = "merged"
            else:
                fate = "rejected"
                rejections.append({"round": r, "learner": learner,
                                   "reason": merge.rejected.get(
                                       learner, "admitted but not in the merge")})
            fates[(r, learner)] = fate
    return offers, fates, rejections


def run_ledger(store: ArtifactStore, cfg: ExperimentConfig) -> tuple[Ledger, list[dict]]:
    P = cfg.sync.num_fragments
    refused: list[dict] = []
    attempts = [record for name in cfg.learners.learner_names
                for record in store.attempt_records(name, refused)]
    offers, fates, rejections = offer_fates(store, P, cfg.learners.learner_names, refused)
    ledger = build_ledger(P, attempts, offers, fates)
    ledger.refused_records = [f"{r['key']}: {r['reason']}" for r in refused]
    return ledger, rejections
