"""A wide screen of candidate configurations, to choose what the quality sweep runs next.

    python benchmarks/quality_screen.py --out /tmp/screen --workers 12        # on an accelerator
    python benchmarks/quality_screen.py --out /tmp/screen --stdlib-root DIR   # the corpus of DIR

Issue 38's sweep runs on 2 CPU cores at about 7 minutes an arm at 1M tokens, so it can try a
handful of configurations a session. This runs a grid around today's defaults (Decoupled
DiLoCo's H, P, tau, outer lr, momentum and warm-up; the learners' schedule; data-parallel at its
two candidate lrs as the reference) on the selection seeds and the validation slice, in many
processes at once, and prints each configuration's mean validation loss against data-parallel at
its best.

Its runs go to their own directory (`--runs-dir`), never to `benchmarks/results/quality/runs/`:
another backend (an accelerator's kernels, another JAX) does not reproduce the CPU figures bit
for bit, so a screen only chooses candidates; the committed sweep then runs them on the
selection seeds and confirms them on seeds 3-5, and only those runs are quoted as results.
`--stdlib-root` points the "stdlib" corpus at another interpreter's library source (a copy of
the CPU machine's), so the screen trains on the same text as the sweep.

Results: `<out>/screen.json` (every run's figures, the grid's summary, the machine, the commit
given by `--commit`), rewritten as each run finishes, so a run cut off at its deadline still
leaves what it finished.
"""

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.quality.experiments import DATA_PARALLEL, DECOUPLED, Arm  # noqa: E402

# Data-parallel's best at 1M and 4M: 4.5e-3 on today's inner clip (0.5) and warm-up (40 steps).
BASELINE = "data-parallel, inner lr 4.5e-3"
DEFAULTS = "Decoupled DiLoCo (defaults)"
# (label, method, overrides): the reference and today's defaults first, then one change at a
# time around the defaults, then the pairs that the single changes suggest.
GRID: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (BASELINE, DATA_PARALLEL, ("inner.lr=0.0045",)),
    ("data-parallel (defaults, inner lr 6e-3)", DATA_PARALLEL, ()),
    (DEFAULTS, DECOUPLED, ()),
    # H must be a multiple of P (the fragments' staggering): H = 2 runs at P = 2 or 1.
    ("H = 2, P = 2", DECOUPLED, ("sync.sync_period=2", "sync.num_fragments=2")),
    ("outer lr 0.7", DECOUPLED, ("outer.lr=0.7",)),
    ("outer lr 0.3", DECOUPLED, ("outer.lr=0.3",)),
    ("outer lr 0.9", DECOUPLED, ("outer.lr=0.9",)),
    ("outer momentum 0.7", DECOUPLED, ("outer.momentum=0.7",)),
    ("outer momentum 0.3", DECOUPLED, ("outer.momentum=0.3",)),
    ("outer momentum warm-up 0", DECOUPLED, ("outer.momentum_warmup_steps=0",)),
    # Either side of the default of 16 (8, its default before, and 32).
    ("outer momentum warm-up 8", DECOUPLED, ("outer.momentum_warmup_steps=8",)),
    ("outer momentum warm-up 32", DECOUPLED, ("outer.momentum_warmup_steps=32",)),
    ("P = 2", DECOUPLED, ("sync.num_fragments=2",)),
    ("P = 1", DECOUPLED, ("sync.num_fragments=1",)),
    ("tau = 0", DECOUPLED, ("sync.overlap_steps=0",)),
    ("outer lr follows the inner schedule", DECOUPLED, ("outer.lr_schedule=inner",)),
    # Either side of the inner warm-up of 40 steps and the clip at 0.5 (the defaults since
    # issue 38's confirmation; 20 and 1.0 before).
    ("inner warm-up 20", DECOUPLED, ("inner.warmup_steps=20",)),
    ("inner warm-up 80", DECOUPLED, ("inner.warmup_steps=80",)),
    ("inner clip at 1.0", DECOUPLED, ("inner.clip_norm=1.0",)),
    ("WSD decay over the last 40%", DECOUPLED, ("inner.wsd_decay_fraction=0.4",)),
    ("H = 2, P = 1", DECOUPLED, ("sync.sync_period=2", "sync.num_fragments=1")),
    ("H = 2, P = 2, outer lr 0.7", DECOUPLED,
     ("sync.sync_period=2", "sync.num_fragments=2", "outer.lr=0.7")),
    ("H = 2, P = 2, outer lr 0.3", DECOUPLED,
     ("sync.sync_period=2", "sync.num_fragments=2", "outer.lr=0.3")),
    ("outer lr 0.7, momentum 0.3", DECOUPLED, ("outer.lr=0.7", "outer.momentum=0.3")),
    ("outer lr 1.0, momentum 0", DECOUPLED, ("outer.lr=1.0", "outer.momentum=0.0")),
)


def screen_arms(tokens: int, seeds: list[int]) -> list[Arm]:
    """The grid's arms, seed-major within each configuration's priority: every configuration's
    first seed before any second seed, so a screen cut off early has seen the whole grid."""
    return [Arm(label, method, overrides, seed, tokens)
            for seed in seeds for label, method, overrides in GRID]


def _use_stdlib_root(root: str | None) -> None:
    """Worker start: the "stdlib" corpus read from `root` instead of this interpreter's."""
    if root:
        import resources.corpus

        resources.corpus.stdlib_root = lambda: Path(root)


def _run(arm: Arm, runs_dir: Path) -> dict:
    from benchmarks.quality.runner import run_arm

    return run_arm(arm, runs_dir)


def summarise(records: list[dict]) -> list[dict]:
    """Each configuration's mean validation loss over the seeds it finished, and the mean of its
    per-seed ratios to the baseline (`slice_report.paired_ratios`; None where the baseline has
    none of its seeds)."""
    from benchmarks.quality.slice_report import paired_ratios

    by_label: dict[str, dict[int, dict]] = {}
    for r in records:
        by_label.setdefault(r["arm"]["label"], {})[r["arm"]["seed"]] = r
    base = by_label.get(BASELINE, {})
    rows = []
    for label, _, _ in GRID:
        mine = by_label.get(label)
        if not mine:
            continue
        ratios = paired_ratios(mine, base, "validation")
        rows.append({"label": label, "seeds": sorted(mine),
                     "validation_mean": statistics.fmean(
                         r["heldout_slices"]["validation"]["loss"] for r in mine.values()),
                     "ratio_to_baseline": statistics.fmean(ratios) if ratios else None,
                     "paired_seeds": sorted(set(mine) & set(base))})
    return rows


def _write(out: Path, records: list[dict], args, started: float, devices: str) -> None:
    body = {"command": " ".join(sys.argv), "commit": args.commit, "devices": devices,
            "tokens": args.tokens, "seeds": args.seeds,
            "elapsed_seconds": round(time.time() - started, 1),
            "summary": summarise(records),
            "runs": [{"label": r["arm"]["label"], "seed": r["arm"]["seed"],
                      "overrides": r["arm"]["overrides"],
                      "validation": r["heldout_slices"]["validation"]["loss"],
                      "test": r["heldout_slices"]["test"]["loss"],
                      "compute_seconds": r["compute_seconds"], "machine": r["machine"],
                      "code": r["code"]} for r in records]}
    tmp = out / "screen.json.tmp"
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(out / "screen.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where screen.json goes")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="where the runs go (default: <out>/runs); never the committed ones")
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stdlib-root", default=None,
                        help="read the 'stdlib' corpus from this directory")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no new run starts and the screen ends")
    parser.add_argument("--commit", default=None, help="the commit, where git is not there")
    args = parser.parse_args()
    from benchmarks.quality.runner import RUNS_DIR, arm_config
    from diloco_core.config_section import ConfigError

    runs_dir = (args.runs_dir or args.out / "runs").resolve()
    if runs_dir == RUNS_DIR.resolve():
        parser.error("--runs-dir must not be the committed runs: a screen's figures are not "
                     "results")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # many processes, one GPU
    import jax

    devices = ", ".join(str(d) for d in jax.devices())
    print(f"devices: {devices}", flush=True)
    started = time.time()
    import multiprocessing

    arms = screen_arms(args.tokens, args.seeds)
    for arm in arms:  # every configuration checked before any compute starts
        try:
            arm_config(arm)
        except ConfigError as err:
            raise SystemExit(f"screen arm {arm.label!r}: {err}") from None
    records: list[dict] = []
    # Its own pool, not `parallel.run_arms`: each worker must read the corpus from
    # --stdlib-root before it imports the data, and the screen stops at a deadline.
    pool = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_use_stdlib_root, initargs=(args.stdlib_root,))
    pending = {pool.submit(_run, arm, runs_dir): arm for arm in arms}
    while pending:
        left = None if args.deadline is None else args.deadline - (time.time() - started)
        if left is not None and left <= 0:
            break
        done, _ = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        for future in done:
            arm = pending.pop(future)
            try:
                record = future.result()
            except Exception as err:  # noqa: BLE001 - one failed arm must not end the screen
                # The worker's own traceback rides on the error's cause: its last lines say why.
                cause = str(err.__cause__ or "").strip().splitlines()[-12:]
                print(f"  {arm.label} (seed {arm.seed}): failed: {err!r}", *cause,
                      sep="\n    ", flush=True)
                continue
            records.append(record)
            print(f"  {arm.label} (seed {arm.seed}): validation "
                  f"{record['heldout_slices']['validation']['loss']:.4f} "
                  f"({record['compute_seconds']} s)", flush=True)
            _write(args.out, records, args, started, devices)
    _write(args.out, records, args, started, devices)
    for row in summarise(records):
        ratio = "-" if row["ratio_to_baseline"] is None else f"{row['ratio_to_baseline']:.4f}"
        print(f"{row['label']:<45} seeds {row['seeds']}  validation "
              f"{row['validation_mean']:.4f}  x{ratio}", flush=True)
    if pending:  # the deadline: the runs still going are dropped, not waited for
        print(f"{len(pending)} runs not finished by the deadline", flush=True)
        os._exit(0)
    pool.shutdown()


if __name__ == "__main__":
    main()
