"""The final rounds: an outer Nesterov step like any round, or the learners' weighted average?

    python benchmarks/final_rounds.py [--tokens 500000 1000000] [--seeds 0 1 2]

After STOP every fragment gets one final round that merges everyone's last progress. Until
then the two arms are the same run (the simulator is deterministic), so the paired difference
of their final held-out losses is exactly what the final rounds' step does. Each run is the
embedded default experiment (Decoupled DiLoCo, M = 4, `small`) on the reference simulator.
Writes `benchmarks/results/final_rounds.json` with the commit, the command and the machine.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipelines.reporting import code_revision, machine_info  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "final_rounds.json"
ARMS = ("outer_step", "average")


def run_one(tokens: int, seed: int, final_rounds: str, data) -> dict:
    from diloco_core.config_loading import config_from_mapping
    from diloco_core.simulator import run_simulation

    cfg = config_from_mapping({}, [f"seed={seed}", f"token_budget={tokens}",
                                   f"outer.final_rounds={final_rounds}"])
    started = time.perf_counter()
    result = run_simulation(cfg, data.learner_streams, data.heldout_stream)
    evals = result.evals
    return {"tokens": tokens, "seed": seed, "final_rounds": final_rounds,
            "final_loss": evals[-1]["loss"],
            "before_final_rounds_loss": evals[-2]["loss"] if len(evals) > 1 else None,
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[500_000, 1_000_000])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    from diloco_core.config_loading import config_from_mapping
    from resources.task_data import load_task_data

    revision = code_revision()     # at the start: the code this process runs
    data = load_task_data(config_from_mapping({}))
    runs = []
    command = "python benchmarks/final_rounds.py " + " ".join(sys.argv[1:])
    for tokens in args.tokens:
        for seed in args.seeds:
            for arm in ARMS:
                runs.append(run_one(tokens, seed, arm, data))
                print(json.dumps(runs[-1]), flush=True)
                write(runs, revision, command)     # an interrupted sweep keeps what ran
    print(json.dumps(write(runs, revision, command)["summary"], indent=1))


def summarize(runs: list[dict]) -> dict:
    """Per budget, over the seeds with both arms: the means and the paired difference."""
    summary = {}
    for tokens in sorted({r["tokens"] for r in runs}):
        pairs = {}
        for r in runs:
            if r["tokens"] == tokens:
                pairs.setdefault(r["seed"], {})[r["final_rounds"]] = r["final_loss"]
        pairs = {seed: p for seed, p in pairs.items() if set(p) == set(ARMS)}
        if not pairs:
            continue
        diffs = [p["average"] - p["outer_step"] for p in pairs.values()]
        summary[str(tokens)] = {
            "outer_step_mean": statistics.fmean(p["outer_step"] for p in pairs.values()),
            "average_mean": statistics.fmean(p["average"] for p in pairs.values()),
            "paired_difference_mean": statistics.fmean(diffs),
            "paired_difference_stderr": (statistics.stdev(diffs) / len(diffs) ** 0.5
                                         if len(diffs) > 1 else None),
            "average_better_in": sum(d < 0 for d in diffs), "seeds": len(diffs)}
    return summary


def write(runs: list[dict], revision: dict, command: str) -> dict:
    record = {"benchmark": "final_rounds", "commit": revision, "command": command,
              "machine": machine_info(), "runs": runs, "summary": summarize(runs)}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
