"""One quality arm at two commits, side by side, scored on the same held-out batches.

    python benchmarks/compare_commits.py --before f098828 --after da87392 \
        --arm "1|Decoupled DiLoCo|1000000|0" --arm "4|K=M|500000|0"

Each commit is checked out in a git worktree under /tmp and the arm (experiment number, label,
token budget, seed: `benchmarks/quality/experiments.py`) runs there, the two commits at once
(2 processes). Reported per arm: each commit's test-slice loss and the paired difference of
the 100 test batches' losses (after - before) with its standard error, tokens, wall seconds,
goodput and rounds. For a change meant to move the simulator's schedule, not its quality
(the simulator driving the syncer's state machine), this says by how much it did.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Runs inside a worktree: its own sources first on the path.
ONE_ARM = r'''
import json, sys
sys.path.insert(0, ".")
from benchmarks.quality.experiments import EXPERIMENTS
from benchmarks.quality.runner import _data, arm_config
from benchmarks.quality.scoring import DEFAULT_SIZES, score_slices
from benchmarks.quality.selection import reseed
from diloco_core.simulator import run_simulation
exp, label, tokens, seed = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
arm = next(a for a in EXPERIMENTS[exp].arms if a.label == label and a.tokens == tokens)
cfg = arm_config(reseed([arm], [seed])[0])
data = _data(cfg)
result = run_simulation(cfg, data.learner_streams, data.heldout_stream)
s = result.summary()
print(json.dumps({"test": score_slices(cfg, result.final_params, data.heldout_stream,
                                        DEFAULT_SIZES)["test"],
                  "tokens": s["tokens_processed"], "wall": s["wall_seconds"],
                  "goodput": s["goodput"], "rounds_merged": s["rounds_merged"],
                  "members": s["mean_members_per_merge"]}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--arm", action="append", required=True,
                        help="'experiment|label|tokens|seed'")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/compare_commits.json"))
    args = parser.parse_args()
    from benchmarks.quality.store_scoring import paired_difference
    from pipelines.reporting import machine_info

    trees = {}
    for which in ("before", "after"):
        tree = Path(tempfile.mkdtemp(prefix=f"compare-{which}-"))
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree),
                        getattr(args, which)], cwd=REPO, check=True)
        trees[which] = tree
    script = Path(tempfile.mkdtemp()) / "one_arm.py"
    script.write_text(ONE_ARM)
    rows = []
    try:
        for spec in args.arm:
            exp, label, tokens, seed = spec.split("|")
            procs = {w: subprocess.Popen([sys.executable, str(script), exp, label, tokens, seed],
                                         cwd=t, stdout=subprocess.PIPE, text=True)
                     for w, t in trees.items()}
            out = {w: json.loads(p.communicate()[0]) for w, p in procs.items()}
            diff = paired_difference(out["after"]["test"]["batch_losses"],
                                     out["before"]["test"]["batch_losses"])
            mean, se = diff["mean"], diff["standard_error"]
            rows.append({"arm": spec, "before": out["before"], "after": out["after"],
                         "test_loss_difference": mean, "standard_error": se})
            print(f"{spec}: test loss {out['before']['test']['loss']:.4f} -> "
                  f"{out['after']['test']['loss']:.4f} (paired {mean:+.4f} +- {se:.4f}); "
                  f"tokens {out['before']['tokens']} -> {out['after']['tokens']}; rounds "
                  f"{out['before']['rounds_merged']} -> {out['after']['rounds_merged']}",
                  flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO)
    Path(args.out).write_text(json.dumps({
        "benchmark": "compare_commits", "before": args.before, "after": args.after,
        "command": "python benchmarks/compare_commits.py " + " ".join(
            f"--{k} {v!r}" for k, v in (("before", args.before), ("after", args.after)))
        + "".join(f" --arm {a!r}" for a in args.arm),
        "machine": machine_info(), "arms": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
