"""What Dagster shows for a round: `global_params` and `heldout_eval` metadata and checks.

One builder for both paths: a merge run (the sensor fallback) yields them as its asset's
results; the quorum sensor mirrors the syncer service's merges and evals as runless
materializations and check evaluations with the same metadata.
"""


from typing import Any, NamedTuple

import dagster as dg

from diloco_core.round_records import RoundDecision, finite_float
from diloco_core.stored_merge import StoredMerge
from resources.store.artifact_store import ArtifactStore, RejectedArtifact
from resources.store.summary_records import HeldoutEval


class RoundCheck(NamedTuple):
    """One asset check's result for a round, as both paths report it (`AssetCheckResult`
    from a run, `AssetCheckEvaluation` from the mirror)."""
    check_name: str
    passed: bool
    severity: dg.AssetCheckSeverity
    metadata: dict[str, Any]

WHY_NOT = {"late": "offered after the grace window closed", "missing": "did not offer",
           "declined": "nothing new on this fragment since it last received it (final round)",
           "not live": "no live heartbeat when the round was decided"}


def _decision_table(record: StoredMerge, decision: RoundDecision,
                    names: list[str]) -> dg.TableMetadataValue:
    """One row per learner of the experiment: merged (weight, tokens, steps, norm), or why
    not (rejected, late, missing, declined, not live)."""
    rows = []
    for name, weight, tokens, steps, norm in zip(
            record.members, record.weights, record.tokens, record.steps,
            record.outer_grad_norms, strict=False):
        rows.append(dg.TableRecord({
            "learner": name, "status": "merged", "weight": round(weight, 4),
            "tokens": tokens, "steps": steps, "outer_grad_norm": round(norm, 5),
            "reason": ""}))
    for name, why in sorted(record.rejected.items()):
        rows.append(dg.TableRecord({"learner": name, "status": "rejected", "weight": 0.0,
                                    "tokens": 0, "steps": 0, "outer_grad_norm": 0.0,
                                    "reason": why}))
    listed = set(record.members) | set(record.rejected)
    accounted = set(decision.late) | set(decision.missing) | set(decision.declined)
    unlisted = [n for n in names if n not in listed and n not in accounted]
    for status, who in (("late", decision.late), ("missing", decision.missing),
                        ("declined", decision.declined), ("not live", unlisted)):
        for name in who:
            if name in listed:
                continue
            listed.add(name)
            rows.append(dg.TableRecord({"learner": name, "status": status, "weight": 0.0,
                                        "tokens": 0, "steps": 0, "outer_grad_norm": 0.0,
                                        "reason": WHY_NOT[status]}))
    schema = dg.TableSchema(columns=[
        dg.TableColumn("learner", "string"), dg.TableColumn("status", "string"),
        dg.TableColumn("weight", "float"), dg.TableColumn("tokens", "int"),
        dg.TableColumn("steps", "int"), dg.TableColumn("outer_grad_norm", "float"),
        dg.TableColumn("reason", "string")])
    return dg.MetadataValue.table(rows, schema)


def _per_learner_series(artifacts, names: list[str], record: StoredMerge, round_index: int,
                        parent_version: int) -> dict[str, float]:
    """Numeric metadata with one stable key per learner, so that the asset page plots each
    learner over rounds: its merge weight (0 when it was not admitted), and for members the
    train loss it reported with its offer and its staleness (merged fragment versions it
    missed since its base)."""
    weights = dict(zip(record.members, record.weights, strict=False))
    series = {f"weight/{n}": round(weights.get(n, 0.0), 4) for n in names}
    for name in record.members:
        # The learner wrote its manifest, `extra` (free-form JSON) and all: every field is
        # checked here, and one that is not what it should be is left out of the plots.
        try:
            manifest = artifacts.contribution_manifest(round_index, name)
        except RejectedArtifact:
            continue
        if manifest is None:
            continue
        loss = finite_float(manifest.extra.get("train_loss"))
        if loss is not None:
            series[f"train_loss/{name}"] = loss
        series[f"staleness/{name}"] = max(0, parent_version - manifest.base_version)
    return series


def global_params_metadata(artifacts: ArtifactStore, record: StoredMerge,
                           decision: RoundDecision, version: int, finite: bool,
                           seconds: float) -> dict:
    """The metadata of one round's `global_params` materialization."""
    latency = record.latency(decision.quorum_at)
    decision_latency = record.latency(decision.decided_at)
    round_index = decision.round if record.round is None else record.round
    # Learners' outer gradients near-orthogonal (cosine ~0) is why the merge uses RDA; only
    # defined with two or more members.
    cosine = ({"mean_pairwise_cosine": record.mean_cosine}
              if record.mean_cosine is not None else {})
    parent_version = version - 1 if record.merged else version
    from diloco_core.config_loading import config_from_mapping

    names = list(config_from_mapping(artifacts.get_config()).learners.learner_names)
    # Norms of a merge that came out not finite are recorded as unknown (None) and left out.
    norms = {k: v for k, v in (("merged_norm", record.merged_norm),
                               ("update_norm", record.update_norm)) if v is not None}
    return {
        **cosine, **norms,
        **_per_learner_series(artifacts, names, record, round_index, parent_version),
        "experiment": artifacts.experiment,
        # A partition may hold several rounds (orchestration.rounds_per_partition): each
        # materialization names its own.
        "round": round_index,
        "fragment": decision.fragment, "version": version,
        "parent_version": parent_version,
        "merged": record.merged and finite,
        "admitted": len(record.members),
        "members": ", ".join(record.members) or "none",
        "late": ", ".join(decision.late) or "none",
        "rejected": len(record.rejected),
        "weights": dg.MetadataValue.json(dict(zip(record.members, record.weights,
                                                  strict=True))),
        "decision_reason": dg.MetadataValue.text(record.reason),
        "decisions": _decision_table(record, decision, names),
        "decided_by": decision.decided_by,
        "merged_by": record.merged_by,
        "grace_seconds": decision.grace_seconds or 0.0,
        "bytes_in": record.bytes_in,
        "merge_seconds": float(seconds),
        "quorum_to_publish_seconds": float(latency) if latency is not None else 0.0,
        "decision_to_publish_seconds": (float(decision_latency)
                                        if decision_latency is not None else 0.0),
        "store": dg.MetadataValue.path(artifacts.blobs.uri),
    }


def round_scalars(metadata: dict) -> dict[str, float]:
    """The plottable numbers of a round's metadata for an outside metrics sink: series keep
    their own group ("weight/learner-0"), the rest go under "merge/" or "eval/"."""
    return {(k if "/" in k else f"merge/{k}"): v for k, v in metadata.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def global_params_checks(record: StoredMerge, version: int,
                         finite: bool) -> list[RoundCheck]:
    outliers = {n: why for n, why in record.rejected.items() if "norm" in why}
    return [
        RoundCheck("params_finite", bool(finite), dg.AssetCheckSeverity.ERROR,
                   {"version": version}),
        RoundCheck("contribution_norms", not outliers, dg.AssetCheckSeverity.WARN,
                   {"excluded": dg.MetadataValue.json(outliers)}),
    ]


def global_params_events(artifacts: ArtifactStore, record: StoredMerge,
                         decision: RoundDecision, version: int, finite: bool, seconds: float):
    """A merge run's results for its `global_params` partition."""
    yield dg.MaterializeResult(metadata=global_params_metadata(
        artifacts, record, decision, version, finite, seconds))
    for check in global_params_checks(record, version, finite):
        yield dg.AssetCheckResult(**check._asdict())


def mirrored_global_params(artifacts: ArtifactStore, partition: str, record: StoredMerge,
                           decision: RoundDecision, version: int) -> list:
    """The same, as runless events for a round the syncer service merged (a partition of one
    round; a partition of several is recorded as one digest, `partition_digest.py`)."""
    finite = record.finite
    key = dg.AssetKey("global_params")
    events: list = [dg.AssetMaterialization(
        asset_key=key, partition=partition,
        description=f"merged by the syncer service: {record.reason}"[:500],
        metadata=global_params_metadata(artifacts, record, decision, version, finite,
                                        record.merge_seconds or 0.0))]
    for check in global_params_checks(record, version, finite):
        events.append(dg.AssetCheckEvaluation(asset_key=key, partition=partition,
                                              **check._asdict()))
    return events


def heldout_eval_metadata(result: HeldoutEval, round_index: int) -> dict:
    return {
        "round": round_index,
        "eval/loss": result.loss, "eval/bits_per_byte": result.bits_per_byte,
        "sample": dg.MetadataValue.md(f"```\n{result.sample}\n```"),
        "versions": dg.MetadataValue.json(list(result.versions)),
        "batches": result.batches,
    }


def eval_regression(result: HeldoutEval, previous: HeldoutEval | None) -> RoundCheck:
    # Only evals on the same held-out batches compare: another set of batches is another
    # measurement (a few batches differ by tens of percent at this scale).
    if previous is not None and previous.batches != result.batches:
        previous = None
    regressed = previous is not None and result.loss > 1.05 * previous.loss
    return RoundCheck("eval_regression", not regressed, dg.AssetCheckSeverity.WARN,
                      {"loss": result.loss,
                       "previous_loss": previous.loss if previous else float("nan")})


def mirrored_eval(partition: str, round_index: int, result: HeldoutEval,
                  previous: HeldoutEval | None) -> list:
    key = dg.AssetKey("heldout_eval")
    return [dg.AssetMaterialization(asset_key=key, partition=partition,
                                    description="evaluated by the syncer service",
                                    metadata=heldout_eval_metadata(result, round_index)),
            dg.AssetCheckEvaluation(asset_key=key, partition=partition,
                                    **eval_regression(result, previous)._asdict())]


# Dagster keeps one runless check evaluation per (asset, check, partition): a second one raises
# in the event log (a unique index), which would fail every later sensor tick. When a partition
# holds several rounds, the mirror therefore holds each round's check results and evaluates the
# partition's checks once, when all its rounds are mirrored: passed only if every round passed,
# naming the rounds that did not.

def hold_checks(held: dict, partition: str, asset: str, checks: list[RoundCheck],
                round_index: int) -> None:
    """Add one round's check results to its partition's pending evaluation (JSON state)."""
    pending = held.setdefault(partition, {})
    for check in checks:
        entry = pending.setdefault(f"{asset}|{check.check_name}", {
            "severity": check.severity.value, "rounds": 0, "failed": []})
        entry["rounds"] += 1
        if not check.passed:
            entry["failed"].append(round_index)


def release_checks(held: dict, upto: int | None, closed_upto: int) -> tuple[list, int]:
    """Evaluate the held checks of every partition whose rounds all lie at or before `upto`
    (None: every partition, the run is finished); returns the events and the last round of
    the partitions evaluated so far (later results for them are dropped, not re-evaluated)."""
    from pipelines.partition_keys import partition_rounds

    events = []
    for partition in sorted(held):
        last = partition_rounds(partition)[-1]
        if upto is not None and last > upto:
            continue
        for name, entry in held.pop(partition).items():
            asset, check_name = name.split("|", 1)
            events.append(dg.AssetCheckEvaluation(
                asset_key=dg.AssetKey(asset), check_name=check_name, partition=partition,
                passed=not entry["failed"],
                severity=dg.AssetCheckSeverity(entry["severity"]),
                metadata={"rounds_checked": entry["rounds"],
                          "failed_rounds": dg.MetadataValue.json(entry["failed"][:100])}))
        closed_upto = max(closed_upto, last)
    return events, closed_upto
