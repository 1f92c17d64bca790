"""What Dagster shows for a round: `global_params` and `heldout_eval` metadata and checks.

One builder for both paths: a merge run (the sensor fallback) yields them as its asset's
results; the quorum sensor mirrors the syncer service's merges and evals as runless
materializations and check evaluations with the same metadata.
"""


import dagster as dg

from diloco_core.round_records import MAX_INT, finite_float
from resources.store.artifact_store import ArtifactStore, RejectedArtifact

WHY_NOT = {"late": "offered after the grace window closed", "missing": "did not offer",
           "declined": "nothing new on this fragment since it last received it (final round)",
           "not live": "no live heartbeat when the round was decided"}


def _decision_table(record: dict, decision: dict, names: list[str]) -> dg.TableMetadataValue:
    """One row per learner of the experiment: merged (weight, tokens, steps, norm), or why
    not (rejected, late, missing, declined, not live)."""
    members = list(record.get("members", []))
    rows = []
    for i, name in enumerate(members):
        rows.append(dg.TableRecord({
            "learner": name, "status": "merged",
            "weight": round(float(record["weights"][i]), 4),
            "tokens": int(record["tokens"][i]), "steps": int(record["steps"][i]),
            "outer_grad_norm": round(float(record["outer_grad_norms"][i]), 5), "reason": ""}))
    for name, why in sorted(record.get("rejected", {}).items()):
        rows.append(dg.TableRecord({"learner": name, "status": "rejected", "weight": 0.0,
                                    "tokens": 0, "steps": 0, "outer_grad_norm": 0.0,
                                    "reason": why}))
    listed = set(members) | set(record.get("rejected", {}))
    unlisted = [n for n in names if n not in listed and not any(
        n in decision.get(s, []) for s in ("late", "missing", "declined"))]
    for status, who in (("late", decision.get("late", [])),
                        ("missing", decision.get("missing", [])),
                        ("declined", decision.get("declined", [])),
                        ("not live", unlisted)):
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


def _per_learner_series(artifacts, names: list[str], record: dict, round_index: int,
                        parent_version: int) -> dict[str, float]:
    """Numeric metadata with one stable key per learner, so that the asset page plots each
    learner over rounds: its merge weight (0 when it was not admitted), and for members the
    train loss it reported with its offer and its staleness (merged fragment versions it
    missed since its base)."""
    members = list(record.get("members", []))
    weights = dict(zip(members, record.get("weights", []), strict=False))
    series = {f"weight/{n}": round(float(weights.get(n, 0.0)), 4) for n in names}
    for name in members:
        # The learner wrote its manifest, `extra` (free-form JSON) and all: every field is
        # checked here, and one that is not what it should be is left out of the plots.
        try:
            manifest = artifacts.contribution_manifest(round_index, name) or {}
        except RejectedArtifact:
            continue
        extra = manifest.get("extra")
        loss = finite_float(extra.get("train_loss")) if isinstance(extra, dict) else None
        if loss is not None:
            series[f"train_loss/{name}"] = loss
        base = manifest.get("base_version")
        if isinstance(base, int) and not isinstance(base, bool) and 0 <= base <= MAX_INT:
            series[f"staleness/{name}"] = max(0, parent_version - base)
    return series


def global_params_metadata(artifacts: ArtifactStore, record: dict, decision: dict,
                           version: int, finite: bool, seconds: float) -> dict:
    """The metadata of one round's `global_params` materialization."""
    latency = decision_latency = None
    if record.get("published_at") and decision.get("quorum_at"):
        latency = record["published_at"] - decision["quorum_at"]
    if record.get("published_at") and decision.get("decided_at"):
        decision_latency = record["published_at"] - decision["decided_at"]
    round_index = int(record.get("round", decision.get("round", 0)))
    # Learners' outer gradients near-orthogonal (cosine ~0) is why the merge uses RDA; only
    # defined with two or more members.
    cosine = ({"mean_pairwise_cosine": float(record["mean_cosine"])}
              if record.get("mean_cosine") is not None else {})
    parent_version = version - 1 if record.get("merged") else version
    from diloco_core.config_loading import config_from_mapping

    names = list(config_from_mapping(artifacts.get_config()).learners.learner_names)
    return {
        **cosine,
        **_per_learner_series(artifacts, names, record, round_index, parent_version),
        "experiment": artifacts.experiment,
        # A partition may hold several rounds (orchestration.rounds_per_partition): each
        # materialization names its own.
        "round": round_index,
        "fragment": int(decision["fragment"]), "version": version,
        "parent_version": parent_version,
        "merged": bool(record.get("merged")) and finite,
        "admitted": len(record.get("members", [])),
        "members": ", ".join(record.get("members", [])) or "none",
        "late": ", ".join(decision.get("late", [])) or "none",
        "rejected": len(record.get("rejected", {})),
        "weights": dg.MetadataValue.json(dict(zip(record.get("members", []),
                                                  record.get("weights", []), strict=True))),
        "decision_reason": dg.MetadataValue.text(record.get("reason", "")),
        "decisions": _decision_table(record, decision, names),
        "decided_by": str(decision.get("decided_by", "sensor")),
        "merged_by": str(record.get("merged_by", "run")),
        "grace_seconds": float(decision.get("grace_seconds") or 0.0),
        "merged_norm": float(record.get("merged_norm", 0.0)),
        "update_norm": float(record.get("update_norm", 0.0)),
        "bytes_in": int(record.get("bytes_in", 0)),
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


def global_params_checks(record: dict, version: int, finite: bool) -> list[dict]:
    outliers = {n: why for n, why in record.get("rejected", {}).items() if "norm" in why}
    return [
        {"check_name": "params_finite", "passed": bool(finite),
         "severity": dg.AssetCheckSeverity.ERROR, "metadata": {"version": version}},
        {"check_name": "contribution_norms", "passed": not outliers,
         "severity": dg.AssetCheckSeverity.WARN,
         "metadata": {"excluded": dg.MetadataValue.json(outliers)}},
    ]


def global_params_events(artifacts: ArtifactStore, record: dict, decision: dict, version: int,
                         finite: bool, seconds: float):
    """A merge run's results for its `global_params` partition."""
    yield dg.MaterializeResult(metadata=global_params_metadata(
        artifacts, record, decision, version, finite, seconds))
    for check in global_params_checks(record, version, finite):
        yield dg.AssetCheckResult(**check)


def mirrored_global_params(artifacts: ArtifactStore, partition: str, record: dict,
                           decision: dict, version: int, with_checks: bool = True) -> list:
    """The same, as runless events for a round the syncer service merged. Without
    `with_checks` the caller holds the checks for its partition (`hold_checks`)."""
    finite = bool(record.get("finite", True))
    key = dg.AssetKey("global_params")
    events: list = [dg.AssetMaterialization(
        asset_key=key, partition=partition,
        description=f"merged by the syncer service: {record.get('reason', '')}"[:500],
        metadata=global_params_metadata(artifacts, record, decision, version, finite,
                                        float(record.get("merge_seconds") or 0.0)))]
    for check in global_params_checks(record, version, finite) if with_checks else []:
        events.append(dg.AssetCheckEvaluation(
            asset_key=key, check_name=check["check_name"], passed=check["passed"],
            severity=check["severity"], metadata=check["metadata"], partition=partition))
    return events


def heldout_eval_metadata(result: dict, round_index: int) -> dict:
    return {
        "round": round_index,
        "eval/loss": result["loss"], "eval/bits_per_byte": result["bits_per_byte"],
        "sample": dg.MetadataValue.md(f"```\n{result['sample']}\n```"),
        "versions": dg.MetadataValue.json(result["versions"]),
        "batches": result["batches"],
    }


def eval_regression(result: dict, previous: dict | None) -> dict:
    # Only evals on the same held-out batches compare: another set of batches is another
    # measurement (a few batches differ by tens of percent at this scale).
    if previous is not None and previous.get("batches") != result.get("batches"):
        previous = None
    regressed = previous is not None and result["loss"] > 1.05 * previous["loss"]
    return {"check_name": "eval_regression", "passed": not regressed,
            "severity": dg.AssetCheckSeverity.WARN,
            "metadata": {"loss": result["loss"],
                         "previous_loss": previous["loss"] if previous else float("nan")}}


def mirrored_eval(partition: str, round_index: int, result: dict, previous: dict | None,
                  with_check: bool = True) -> list:
    key = dg.AssetKey("heldout_eval")
    events: list = [dg.AssetMaterialization(asset_key=key, partition=partition,
                                            description="evaluated by the syncer service",
                                            metadata=heldout_eval_metadata(result, round_index))]
    if with_check:
        events.append(dg.AssetCheckEvaluation(asset_key=key, partition=partition,
                                              **eval_regression(result, previous)))
    return events


# Dagster keeps one runless check evaluation per (asset, check, partition): a second one raises
# in the event log (a unique index), which would fail every later sensor tick. When a partition
# holds several rounds, the mirror therefore holds each round's check results and evaluates the
# partition's checks once, when all its rounds are mirrored: passed only if every round passed,
# naming the rounds that did not.

def hold_checks(held: dict, partition: str, asset: str, checks: list[dict],
                round_index: int) -> None:
    """Add one round's check results to its partition's pending evaluation (JSON state)."""
    pending = held.setdefault(partition, {})
    for check in checks:
        entry = pending.setdefault(f"{asset}|{check['check_name']}", {
            "severity": check["severity"].value, "rounds": 0, "failed": []})
        entry["rounds"] += 1
        if not check["passed"]:
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
