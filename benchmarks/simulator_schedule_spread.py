"""How much of the orchestrated-vs-simulator loss gap is the schedule: the reference simulator
on the demo's config and calibrated clock, with the learners' step times jittered.

    python benchmarks/simulator_schedule_spread.py        # ~12 min on 2 cores

`benchmarks/orchestration_demo.py` compares one orchestrated run with one simulated run on the
same config and measured clock; both are one sample of when each offer lands relative to each
merge. Here the simulator runs the same config (the demo's embedded defaults) and the clock
calibrated in the committed demo result, with `simulation.step_jitter` at 0, 5%, 10% and 20%:
the same initial parameters and data order, only the interleaving of steps, offers and merges
differs. The spread of the final held-out loss across them says how far apart two runs of one
algorithm on one config land from schedule alone, which is the scale against which the demo's
gap to the simulator is read. Writes `benchmarks/results/simulator_schedule_spread.json`.
"""

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipelines.reporting import code_revision, machine_info  # noqa: E402

DEMO = REPO / "benchmarks" / "results" / "orchestration_demo.json"
OUT = REPO / "benchmarks" / "results" / "simulator_schedule_spread.json"
JITTERS = (0.0, 0.05, 0.1, 0.2)


def run(overrides: list[str]) -> dict:
    from diloco_core.simulator import run_simulation
    from pipelines.commands.cli import load_config
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
    from resources.corpus import load_corpus

    cfg = load_config(None, overrides, base=ORCHESTRATED_DEFAULTS)
    corpus = load_corpus(cfg.data.corpus, cfg.learners.num_learners, cfg.data.heldout_fraction)
    started = time.perf_counter()
    s = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream).summary()
    return {"final_heldout_loss": s["final_heldout_loss"], "rounds_merged": s["rounds_merged"],
            "tokens": s["tokens_processed"], "wall_seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    revision = code_revision()
    demo = json.loads(DEMO.read_text())
    calibration = demo["calibrated_clock"]
    base = [f"{k}={json.dumps(v)}" for k, v in calibration.items()]
    runs = []
    for jitter in JITTERS:
        result = run([*base, f"simulation.step_jitter={jitter}"])
        runs.append({"step_jitter": jitter, **result})
        print(f"jitter {jitter:.2f}: loss {result['final_heldout_loss']:.4f}, "
              f"{result['rounds_merged']} merges", flush=True)
    losses = [r["final_heldout_loss"] for r in runs]
    demo_loss = demo["demo"]["final_eval_loss"]
    mean = statistics.mean(losses)
    result = {
        "benchmark": "simulator_schedule_spread",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(), **revision,
        "command": "python benchmarks/simulator_schedule_spread.py",
        "calibrated_clock": calibration,
        "demo_result": {"commit": demo.get("commit"), "final_eval_loss": demo_loss},
        "runs": runs,
        "loss_min": min(losses), "loss_max": max(losses), "loss_mean": mean,
        "loss_spread_relative": (max(losses) - min(losses)) / mean,
        "demo_vs_mean": demo_loss / mean,
        "demo_within_range": min(losses) <= demo_loss <= max(losses),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"simulator losses {min(losses):.3f}..{max(losses):.3f} (spread "
          f"{result['loss_spread_relative']:.1%} of the mean {mean:.3f}); the demo's "
          f"{demo_loss:.3f} is {result['demo_vs_mean']:.3f}x the mean")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
