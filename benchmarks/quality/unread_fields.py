"""Config fields a baseline does not read, and the stored runs' copies of them.

A stored run records its whole config, and `runner.load_arm` reuses it only while that config is
what its arm resolves to today. Data-parallel has no syncer and no outer step, and synchronous
DiLoCo sets several sync fields itself (`diloco_core.baselines.synchronous_config`), so a
changed default among those fields (issue 38 moved `sync.merge_rule` to the mean) cannot change
their figures, yet would refuse every baseline run and re-run hours of identical work.
`settle_unread_fields` sets those fields of each stored baseline run to what its arm resolves
to today (the defaults unless the arm overrides them) and keeps what the run recorded under
`config_as_run`, before `runner.rekey_runs` files the run under its key. (This lives outside
`runner.py`, whose code is in the quality code hash.)
"""

import json
from pathlib import Path

from benchmarks.quality.experiments import DATA_PARALLEL, SYNCHRONOUS, Arm

# The sync fields synchronous_config sets (a test keeps the two in step).
SYNCHRONOUS_SETS = ("num_fragments", "overlap_steps", "min_quorum", "block_on_overlap",
                    "grace_gamma", "grace_min_seconds", "merge_rule", "weighting",
                    "receive_rule")
UNREAD = {DATA_PARALLEL: {"sync": None, "outer": None},
          SYNCHRONOUS: {"sync": SYNCHRONOUS_SETS}}


def _arm_of(record: dict) -> Arm:
    a = record["arm"]
    return Arm(a["label"], a["method"], tuple(a.get("overrides", ())), a.get("seed", 0),
               a.get("tokens", 0))


def _settled(record: dict) -> dict | None:
    """The record's config with the fields its method does not read at the values its arm
    resolves to today (the defaults, or the arm's own overrides: an arm that sets one must keep
    finding its run, and the config must stay valid), or None when the arm no longer resolves
    (an override of a field since removed: such a run is refused anyway)."""
    from benchmarks.quality.runner import arm_config
    from diloco_core.config import ConfigError
    from diloco_core.config_loading import config_to_mapping

    unread = UNREAD.get(record["arm"]["method"])
    # A record that names no code or commit predates provenance: nothing can say what computed
    # it, so it is left as it was written rather than rewritten without a commit to cite.
    if not unread or not record.get("code") or not record.get("commit"):
        return None
    try:
        today = json.loads(json.dumps(config_to_mapping(arm_config(_arm_of(record)))))
    except (ConfigError, KeyError, TypeError, ValueError):
        return None
    out = json.loads(json.dumps(record["config"]))
    for section, names in unread.items():
        for name in names or today[section]:
            if name in today[section]:
                out.setdefault(section, {})[name] = today[section][name]
    return out


def settle_unread_fields(runs_dir: Path) -> list[str]:
    """Set every stored baseline run's unread fields to what its arm resolves to today (the
    run's own record kept as `config_as_run`); return the runs changed."""
    changed = []
    for path in sorted(runs_dir.glob("*.json")):
        record = json.loads(path.read_text())
        settled = _settled(record)
        if settled is not None and settled != record["config"]:
            record.setdefault("config_as_run", record["config"])
            record["config"] = settled
            tmp = path.with_suffix(".settle")
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(path)
            changed.append(path.stem)
    return changed
