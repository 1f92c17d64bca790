"""What Dagster records of a partition that holds several rounds: one digest per asset.

A long run groups whole outer steps into one partition of the round assets
(`orchestration.rounds_per_partition`), so that a month at the paper's cadence stays within
Dagster's advised partitions per asset. A materialization per round would still grow the
instance's database by the round: about 48 KB a merged round at M = 4 (a `global_params`
materialization, a `learner_update` per offer, each event stored twice), 120 GB a month at a
round a second, and Dagster's SQL event storage cannot delete a partition's events. So the
quorum sensor, mirroring the syncer service, holds each round's figures in its cursor and
records one materialization per asset and partition once all its rounds are mirrored: for
`global_params` the partition's rounds (merged, refused), last versions, members and latencies;
for `learner_update` one per learner with its offers, tokens, steps, bytes and late offers; for
`heldout_eval` the partition's last eval (a learner's digest once the partition's rounds are
closed to late offers). The database then grows by the partition, at most
`ROUND_PARTITIONS_MAX` of them a run. Every round's detail stays in the store (its decision,
merge record, offers and eval; `diloco status`, the token ledger). A run with one round per
partition (every run of up to 10,000 rounds) records each round as before.
"""

import math
from typing import Any

import dagster as dg

from diloco_core.round_records import RoundDecision
from diloco_core.stored_merge import StoredMerge
from pipelines.offer_summary import OfferSummary
from pipelines.partition_keys import learner_partition_key, partition_rounds
from resources.store.summary_records import HeldoutEval


def hold_merge(held: dict, partition: str, round_index: int, record: StoredMerge,
               decision: RoundDecision, version: int) -> None:
    """Add one round the syncer merged (or refused) to its partition's `global_params`
    digest (JSON state in the sensor's cursor: counts, sums and extremes, so its size does
    not grow with the rounds a partition holds)."""
    d = held.setdefault(partition, {}).setdefault("global_params", {
        "rounds": 0, "merged": 0, "first_round": round_index, "last_round": round_index,
        "versions": {}, "admitted": _running(), "rejected": 0, "late": 0, "bytes_in": 0,
        "merge_seconds": _running(), "decision_to_publish_seconds": _running(),
        "reason": ""})
    d["rounds"] += 1
    d["merged"] += int(record.merged and record.finite)
    d["first_round"] = min(d["first_round"], round_index)
    d["last_round"] = max(d["last_round"], round_index)
    d["versions"][str(decision.fragment)] = max(version, d["versions"].get(
        str(decision.fragment), version))
    _add(d["admitted"], len(record.members))
    d["rejected"] += len(record.rejected)
    d["late"] += len(decision.late)
    d["bytes_in"] += int(record.bytes_in or 0)
    _add(d["merge_seconds"], float(record.merge_seconds or 0.0))
    latency = record.latency(decision.decided_at)
    _add(d["decision_to_publish_seconds"], float(latency) if latency is not None else 0.0)
    if round_index == d["last_round"]:
        d["reason"] = record.reason[:300]


def _running() -> dict:
    return {"n": 0, "sum": 0.0, "min": None, "max": None}


def _add(stat: dict, value: float) -> None:
    if not math.isfinite(value):
        return
    stat["n"] += 1
    stat["sum"] += value
    stat["min"] = value if stat["min"] is None else min(stat["min"], value)
    stat["max"] = value if stat["max"] is None else max(stat["max"], value)


def hold_offer(held: dict, partition: str, offer: OfferSummary) -> None:
    """Add one offer to its learner's `learner_update` digest for the partition."""
    d = held.setdefault(partition, {}).setdefault("learners", {}).setdefault(offer.learner, {
        "offers": 0, "tokens": 0, "steps": 0, "nbytes": 0, "late": 0, "refused": 0,
        "staleness_max": 0, "last_round": offer.round, "train_loss": None, "problem": ""})
    d["offers"] += 1
    for name in ("tokens", "steps", "nbytes"):
        d[name] += int(getattr(offer, name) or 0)
    d["late"] += int(offer.late)
    d["staleness_max"] = max(d["staleness_max"], int(offer.staleness or 0))
    if offer.problem:
        d["refused"] += 1
        d["problem"] = offer.problem[:300]
    if offer.round >= d["last_round"]:
        d["last_round"] = offer.round
        if offer.train_loss is not None:
            d["train_loss"] = offer.train_loss


def hold_eval(held: dict, partition: str, round_index: int, evaluation: HeldoutEval) -> None:
    """Keep the partition's latest eval (what its `heldout_eval` digest shows)."""
    d = held.setdefault(partition, {})
    count = d.get("eval", {}).get("evals", 0) + 1
    if round_index >= d.get("eval", {}).get("round", -1):
        kept = evaluation.model_dump(mode="json", include=set(HeldoutEval.model_fields))
        d["eval"] = {"round": round_index, "evals": count,
                     "eval": {**kept, "sample": evaluation.sample[:2000]}}
    else:
        d["eval"]["evals"] = count


def release(held: dict, upto: int | None, experiment: str,
            offers_upto: int | None = None) -> list:
    """The digests due, as materializations, dropped from `held`: a partition's
    `global_params` and `heldout_eval` once all its rounds lie at or before `upto` (mirrored),
    its learners' `learner_update` once they lie at or before `offers_upto` too (closed to
    offers: a round takes late offers for LATE_WINDOW rounds after it is decided, and the
    mirror reports none after that), so each learner's digest has every offer it reported.
    None: due (the run is finished and every round mirrored)."""
    from pipelines.round_metadata import heldout_eval_metadata

    def due(partition: str, limit: int | None) -> bool:
        return limit is None or partition_rounds(partition)[-1] <= limit

    events: list = []
    for partition in sorted(held):
        d = held[partition]
        if due(partition, upto):
            if "global_params" in d:
                params = d.pop("global_params")
                events.append(dg.AssetMaterialization(
                    asset_key="global_params", partition=partition,
                    description=f"{params['rounds']} rounds merged by the syncer service (one "
                                "digest per partition; every round in the store)",
                    metadata=_params_metadata(params, experiment)))
            if "eval" in d:
                held_eval = d.pop("eval")
                evaluation = HeldoutEval.model_validate(held_eval["eval"])
                events.append(dg.AssetMaterialization(
                    asset_key="heldout_eval", partition=partition,
                    description="the partition's latest eval by the syncer service",
                    metadata={**heldout_eval_metadata(evaluation, held_eval["round"]),
                              "evals_in_partition": held_eval["evals"]}))
        if due(partition, upto) and due(partition, offers_upto):
            for learner, figures in sorted(d.pop("learners", {}).items()):
                events.append(dg.AssetMaterialization(
                    asset_key="learner_update",
                    partition=dg.MultiPartitionKey({
                        "round": partition,
                        "learner": learner_partition_key(experiment, learner)}),
                    metadata=_learner_metadata(figures)))
        if not d:
            del held[partition]
    return events


def _summary(stat: dict, name: str) -> dict[str, float]:
    if not stat["n"]:
        return {}
    return {f"{name}_mean": round(stat["sum"] / stat["n"], 6),
            f"{name}_max": round(stat["max"], 6)}


def _params_metadata(d: dict, experiment: str) -> dict[str, Any]:
    admitted = d["admitted"]
    return {
        "experiment": experiment,
        # The round of the partition's last merge: as a round's own materialization does.
        "round": d["last_round"],
        "first_round": d["first_round"],
        "rounds": d["rounds"], "rounds_merged": d["merged"],
        "versions": dg.MetadataValue.json({int(k): v for k, v in d["versions"].items()}),
        "admitted_mean": round(admitted["sum"] / admitted["n"], 3) if admitted["n"] else 0.0,
        "admitted_min": int(admitted["min"] or 0),
        "rejected": d["rejected"], "late": d["late"], "bytes_in": d["bytes_in"],
        **_summary(d["merge_seconds"], "merge_seconds"),
        **_summary(d["decision_to_publish_seconds"], "decision_to_publish_seconds"),
        "last_decision_reason": dg.MetadataValue.text(d["reason"]),
    }


def _learner_metadata(d: dict) -> dict[str, Any]:
    metadata: dict[str, Any] = {k: d[k] for k in ("offers", "tokens", "steps", "nbytes",
                                                  "late", "refused", "staleness_max")}
    metadata["round"] = d["last_round"]
    if d["train_loss"] is not None:
        metadata["train/loss"] = d["train_loss"]
    if d["problem"]:
        metadata["problem"] = dg.MetadataValue.text(d["problem"])
    return metadata
