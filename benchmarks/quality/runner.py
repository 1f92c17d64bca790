"""Running one arm on the reference simulator and keeping its figures.

Each arm's result is a JSON file named by a hash of its full config and method, so an arm shared
by two experiments runs once, and an interrupted sweep resumes where it stopped. Each result
also records `code`, a hash of the code that computes it (`code_identity`), and the commit: a
stored result whose code hash is not the tree's is stale, and `run_arm` runs it again (a cache
never outlives the code it caches); the reports say which results are stale. A result scored on
slices of other sizes than asked for is run again too (`scoring`).
Nothing is pickled: results are plain JSON figures, never parameters.
"""

import hashlib
import json
import statistics
import time
from pathlib import Path

from benchmarks.quality.code_identity import REPO, code_hash, is_current
from benchmarks.quality.experiments import DATA_PARALLEL, DECOUPLED, SYNCHRONOUS, Arm
from benchmarks.quality.scoring import DEFAULT_SIZES, SliceSizes, score_slices, sizes_of
from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_from_mapping, config_to_mapping

RUNS_DIR = REPO / "benchmarks" / "results" / "quality" / "runs"


def arm_config(arm: Arm) -> ExperimentConfig:
    return config_from_mapping({}, arm.all_overrides())


def _leaves(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _stored_form(mapping: dict) -> dict:
    """A config mapping as a stored record holds it (JSON: tuples become lists)."""
    return _leaves(json.loads(json.dumps(mapping)))


def config_key(method: str, config: dict) -> str:
    """A hash of the method and of the config's fields that differ from today's defaults:
    adding a config field (at a default that keeps old behaviour) leaves every stored result
    valid."""
    defaults = _stored_form(config_to_mapping(ExperimentConfig()))
    changed = {k: v for k, v in _stored_form(config).items()
               if k not in defaults or defaults[k] != v}
    body = json.dumps({"method": method, "config": changed}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def arm_key(arm: Arm) -> str:
    return config_key(arm.method, config_to_mapping(arm_config(arm)))


def rekey_runs(runs_dir: Path = RUNS_DIR) -> list[tuple[str, str]]:
    """Move every stored run to the key its recorded config has under today's defaults, and
    return the moves (old key, new key). The key names only the fields that differ from the
    defaults, so when a default changes, the runs made at the new value (under overrides then)
    become the plain arm's and the plain arm's old runs take the key of the old value: no run
    repeats for a default the runs themselves chose. Only runs of today's code move (a stale
    one can only be shown as stale, and where its config is not its arm's today `load_arm`
    already refuses it); one moving onto a stale run's key replaces it, as a re-run would."""
    moves = []
    staged = []
    for path in sorted(runs_dir.glob("*.json")):
        record = json.loads(path.read_text())
        key = config_key(record["arm"]["method"], record["config"])
        if is_current(record) and path.stem != key:
            staged.append((path, key, record))
    # Through temporary names first: one run's new key may be another's old one.
    for path, key, record in staged:
        tmp = path.with_suffix(".rekey")
        tmp.write_text(json.dumps({**record, "key": key}, indent=1))
        path.unlink()
    for path, key, _ in staged:
        path.with_suffix(".rekey").replace(runs_dir / f"{key}.json")
        moves.append((path.stem, key))
    return moves


def arm_path(arm: Arm, runs_dir: Path = RUNS_DIR) -> Path:
    return runs_dir / f"{arm_key(arm)}.json"


def load_arm(arm: Arm, runs_dir: Path = RUNS_DIR) -> dict | None:
    """The stored result of the arm's configuration, or None: none stored, or one stored under
    the same key when a default meant something else (the key names only the fields that
    differ from the defaults, so a changed default moves every arm that does not override it
    onto the key of runs made under the old one). A field added since the run is no conflict:
    it sits at a default that keeps the old behaviour."""
    path = arm_path(arm, runs_dir)
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    now = _leaves(json.loads(json.dumps(config_to_mapping(arm_config(arm)))))
    then = _leaves(record["config"])
    if any(name in now and now[name] != value for name, value in then.items()):
        return None
    return record


_DATA: dict[tuple, object] = {}


def _data(cfg: ExperimentConfig):
    """The arm's data, loaded once per split: the text corpus split does not depend on the
    seed, the digits split does."""
    from resources.task_data import load_task_data

    key = (cfg.task, cfg.data.corpus, cfg.learners.num_learners, cfg.data.heldout_fraction,
           cfg.seed if cfg.task == "digits" else None)
    if key not in _DATA:
        _DATA[key] = load_task_data(cfg)
    return _DATA[key]


def _merge_figures(merges) -> dict:
    """Per-merge diagnostics over the rounds that merged 2+ learners (experiment 5)."""
    multi = [m for m in merges if m.merged and len(m.members) >= 2]
    ratios = [m.merged_norm / statistics.fmean(m.outer_grad_norms) for m in multi
              if m.outer_grad_norms and statistics.fmean(m.outer_grad_norms) > 0]
    cosines = [m.mean_cosine for m in multi if m.mean_cosine is not None]
    merged = [m for m in merges if m.merged]
    upload = [m.bytes_in / len(m.members) for m in merged if m.members]
    return {
        "merged_norm_ratio_median": statistics.median(ratios) if ratios else None,
        "mean_cosine_median": statistics.median(cosines) if cosines else None,
        "mean_members_per_merge": statistics.fmean(len(m.members) for m in merged)
        if merged else 0.0,
        "max_contribution_bytes": max(upload) if upload else 0,
        "weights_by_learner": _mean_weights(merged),
    }


def _mean_weights(merged) -> dict[str, float]:
    """Each learner's mean merge weight over the rounds that admitted it."""
    seen: dict[str, list[float]] = {}
    for m in merged:
        for name, w in zip(m.members, m.weights, strict=True):
            seen.setdefault(name, []).append(w)
    return {name: statistics.fmean(ws) for name, ws in sorted(seen.items())}


def _fragment_bytes(cfg: ExperimentConfig, final_params) -> int:
    """fp32 bytes of the largest fragment (what a learner downloads per merged round)."""
    from diloco_core.fragments import plan_fragments

    plan = plan_fragments({k: v.shape for k, v in final_params.items()},
                          cfg.sync.num_fragments)
    return 4 * max(plan.sizes)


def is_usable(record: dict | None, sizes: SliceSizes = DEFAULT_SIZES) -> bool:
    """Whether a stored result can stand: computed by this tree's code and, for text, scored on
    slices of the sizes asked for."""
    if record is None or not is_current(record):
        return False
    return record["config"].get("task") == "digits" or sizes_of(record) == sizes


def run_arm(arm: Arm, runs_dir: Path = RUNS_DIR, progress=None,
            sizes: SliceSizes = DEFAULT_SIZES) -> dict:
    """Run one arm (or return its stored result) and write its figures as JSON."""
    stored = load_arm(arm, runs_dir)
    if is_usable(stored, sizes):
        return stored
    from diloco_core.baselines import run_data_parallel, run_synchronous_diloco
    from diloco_core.simulator import run_simulation
    from pipelines.reporting import code_revision, machine_info

    cfg = arm_config(arm)
    data = _data(cfg)
    runner = {DECOUPLED: run_simulation, SYNCHRONOUS: run_synchronous_diloco,
              DATA_PARALLEL: run_data_parallel}[arm.method]
    started = time.perf_counter()
    result = runner(cfg, data.learner_streams, data.heldout_stream, progress=progress)
    elapsed = time.perf_counter() - started
    started = time.perf_counter()
    slices = score_slices(cfg, result.final_params, data.heldout_stream, sizes)
    scoring = time.perf_counter() - started
    summary = result.summary()
    record = {
        "arm": {"label": arm.label, "method": arm.method, "seed": arm.seed,
                "tokens": arm.tokens, "overrides": list(arm.overrides)},
        "key": arm_key(arm),
        "code": code_hash(),
        "commit": code_revision(),
        "machine": machine_info(),
        "compute_seconds": round(elapsed, 1),
        "scoring_seconds": round(scoring, 1),
        # The figures to report (validation: for tuning; test: for reporting); the summary's
        # final_heldout_loss (the stream's first 8 KB) is kept for continuity only.
        "heldout_slices": slices,
        "config": config_to_mapping(cfg),
        "summary": summary,
        "idle_fraction": _idle_fraction(summary),
        "fragment_fp32_bytes": _fragment_bytes(cfg, result.final_params),
        **_merge_figures(result.merges),
    }
    runs_dir.mkdir(parents=True, exist_ok=True)
    path = arm_path(arm, runs_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # a result file exists only once complete
    return record


def _idle_fraction(summary: dict) -> float:
    busy = sum(s["busy_seconds"] for s in summary["learners"])
    idle = sum(s["idle_seconds"] for s in summary["learners"])
    return idle / (busy + idle) if busy + idle else 0.0
