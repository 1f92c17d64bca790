"""Pacing on or off (`sync.block_on_overlap`): which default, for the simulator and the real path.

With pacing a learner waits while it is tau steps past an offer whose merge has not come back,
or H/P + tau steps past the newest opened round (`round_protocol.held_by_pacing`). Without it a
learner never waits, as in the paper ("the overall training never stops"). Both paths share
the rule and its default, so the default is chosen here, on the reference simulator at the
orchestrated defaults (4 learners at speeds 1, 1, 0.7, 0.5, K = 2, P = 4, H = 16, tau = 2,
rebase; `pipelines/launch_defaults.py`), each seed run both ways at equal tokens.

Figures per run: the final parameters' held-out loss on a large slice (`--eval-batches`
batches spread evenly over the whole held-out stream, not the first 8 KB), the simulated time
to the budget, goodput (useful step time over allocated time) and the learners' idle fraction.
Reported: per-seed ratios off / on, their median and range.

    python benchmarks/pacing.py                  # 3 seeds x 2 settings, ~25 min on 2 cores
"""

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEFAULT_OUT = REPO / "benchmarks" / "results" / "pacing.json"


def run_one(args: tuple[bool, int, int, int]) -> dict:
    pacing, seed, budget, eval_batches = args
    from diloco_core.eval_slices import spread_batches
    from diloco_core.evaluation import evaluate
    from diloco_core.model import make_model_def
    from diloco_core.simulator import run_simulation
    from pipelines.commands.cli import load_config
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
    from resources.task_data import load_task_data

    cfg = load_config(None, [f"token_budget={budget}", f"seed={seed}",
                             f"sync.block_on_overlap={str(pacing).lower()}"],
                      base=ORCHESTRATED_DEFAULTS)
    data = load_task_data(cfg)
    started = time.perf_counter()
    result = run_simulation(cfg, data.learner_streams, data.heldout_stream)
    compute = time.perf_counter() - started
    batches = spread_batches(data.heldout_stream, cfg.data.batch_size, cfg.data.seq_len,
                             eval_batches)
    loss = evaluate(make_model_def(cfg.model), result.final_params, batches)["loss"]
    summary = result.summary()
    busy = sum(s["busy_seconds"] for s in summary["learners"])
    idle = sum(s["idle_seconds"] for s in summary["learners"])
    return {"pacing": pacing, "seed": seed, "heldout_loss": loss,
            "first_8kb_loss": result.final_loss, "wall_seconds": result.wall_seconds,
            "goodput": result.goodput, "idle_fraction": idle / (busy + idle),
            "tokens": result.tokens_processed, "merges": len(result.merges),
            "compute_seconds": round(compute, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=800_000)
    parser.add_argument("--eval-batches", type=int, default=96)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    from pipelines.reporting import code_revision, machine_info

    revision = code_revision()
    jobs = [(pacing, seed, args.budget, args.eval_batches)
            for seed in args.seeds for pacing in (True, False)]
    with ProcessPoolExecutor(args.workers) as pool:
        runs = list(pool.map(run_one, jobs))
    for r in runs:
        print(f"seed {r['seed']} pacing {'on ' if r['pacing'] else 'off'}: loss "
              f"{r['heldout_loss']:.4f} (first 8 KB {r['first_8kb_loss']:.4f}), "
              f"{r['wall_seconds']:.0f} s simulated, goodput {r['goodput']:.3f}, "
              f"idle {r['idle_fraction']:.3f}")
    by = {(r["seed"], r["pacing"]): r for r in runs}
    ratios = {key: [by[(s, False)][key] / by[(s, True)][key] for s in args.seeds]
              for key in ("heldout_loss", "wall_seconds", "goodput")}
    figures = {key: {"median": statistics.median(v), "min": min(v), "max": max(v)}
               for key, v in ratios.items()}
    for key, f in figures.items():
        print(f"off / on, {key}: median {f['median']:.4f} (range {f['min']:.4f}-"
              f"{f['max']:.4f})")
    record = {"benchmark": "pacing", "when": datetime.now(UTC).isoformat(timespec="seconds"),
              **revision, "machine": machine_info(),
              "command": "python benchmarks/pacing.py " + " ".join(sys.argv[1:]),
              "config": "pipelines/launch_defaults.py ORCHESTRATED_DEFAULTS, token_budget "
                        f"{args.budget}, sync.block_on_overlap true/false",
              "eval": f"{args.eval_batches} batches spread over the whole held-out stream",
              "runs": runs, "ratios_off_over_on": {k: v for k, v in ratios.items()},
              "figures_off_over_on": figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
