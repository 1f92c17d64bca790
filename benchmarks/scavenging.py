"""Compute scavenging: extra learners join a run for a while, as reclaimable capacity does.

    python benchmarks/scavenging.py [--tokens 500000] [--extras 0 1 2 4 12]

A base of 4 learners trains the embedded default experiment (`small`, Decoupled DiLoCo with
K = 1 and the grace window) to a token budget; extra capacity of +25%, +50%, +100% and +300%
(1, 2, 4 and 12 more learners of the same speed) is there for the middle half of the run (from
25% to 75% of its nominal length). Decoupled DiLoCo takes each extra learner in as it comes (the
global parameters and a peer's AdamW state, its own unread data shard) and lets it go without
waiting for it; data-parallel uses it as an elastic global batch. For each method: the time to
the budget on the simulator's clock and the final held-out loss, against the same method
without extra capacity. Runs go through the quality runner (`benchmarks/quality/runner.py`),
so each is stored with the code hash and commit that computed it and reused while the code is
unchanged. Writes `benchmarks/results/scavenging.json` and `docs/img/scavenging.png`.
"""

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.quality.experiments import DATA_PARALLEL, DECOUPLED, Arm  # noqa: E402
from pipelines.reporting import code_revision, machine_info  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "scavenging.json"
PLOT = REPO / "docs" / "img" / "scavenging.png"
BASE_LEARNERS = 4
WINDOW = (0.25, 0.75)          # the extra capacity's presence, as fractions of the run
METHODS = {DECOUPLED: "Decoupled DiLoCo", DATA_PARALLEL: "data-parallel (elastic batch)"}


def arm(method: str, extra: int, tokens: int) -> Arm:
    overrides = [f"learners.num_learners={BASE_LEARNERS + extra}"]
    if extra:
        windows = ", ".join(f"{{learner: {BASE_LEARNERS + i}, join: {WINDOW[0]}, "
                            f"leave: {WINDOW[1]}}}" for i in range(extra))
        overrides.append(f"simulation.capacity=[{windows}]")
    return Arm(f"+{100 * extra // BASE_LEARNERS}% capacity", method, tuple(overrides), 0, tokens)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for method, label in METHODS.items():
        mine = sorted((r for r in rows if r["method"] == method),
                      key=lambda r: r["extra_capacity_percent"])
        xs = [r["extra_capacity_percent"] for r in mine]
        time_ax.plot(xs, [r["time_vs_base"] for r in mine], marker="o", label=label)
        loss_ax.plot(xs, [r["loss_vs_base"] for r in mine], marker="o", label=label)
    time_ax.set_ylabel("time to the token budget / without extra capacity")
    loss_ax.set_ylabel("final held-out loss / without extra capacity")
    for ax in (time_ax, loss_ax):
        ax.set_xlabel("extra capacity for the middle half of the run (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Compute scavenging: 4 learners plus capacity that comes and goes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=500_000)
    parser.add_argument("--extras", type=int, nargs="+", default=[0, 1, 2, 4, 12],
                        help="extra learners (0 is the base run every ratio refers to)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--plot", default=str(PLOT))
    parser.add_argument("--runs-dir", help="where runs are stored (default: the quality runs)")
    args = parser.parse_args()
    if 0 not in args.extras:
        parser.error("--extras must include 0, the base run")
    from benchmarks.quality.runner import RUNS_DIR, run_arm

    revision = code_revision()   # before the runs: the code they ran
    rows = []
    for extra in sorted(args.extras):
        for method in METHODS:
            record = run_arm(arm(method, extra, args.tokens),
                             Path(args.runs_dir) if args.runs_dir else RUNS_DIR)
            summary = record["summary"]
            rows.append({"method": method, "extra_learners": extra,
                         "extra_capacity_percent": 100 * extra // BASE_LEARNERS,
                         "wall_seconds": summary["wall_seconds"],
                         "final_heldout_loss": summary["final_heldout_loss"],
                         "tokens": summary["tokens_processed"],
                         "run": record["key"], "run_commit": record["commit"]})
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        base = next(r for r in rows if r["method"] == row["method"] and r["extra_learners"] == 0)
        row["time_vs_base"] = round(row["wall_seconds"] / base["wall_seconds"], 4)
        row["loss_vs_base"] = round(row["final_heldout_loss"] / base["final_heldout_loss"], 4)
    result = {"benchmark": "scavenging", "when": datetime.now(UTC).isoformat(timespec="seconds"),
              **revision, "machine": machine_info(),
              "command": "python benchmarks/scavenging.py " + " ".join(sys.argv[1:]),
              "base_learners": BASE_LEARNERS, "window": list(WINDOW), "tokens": args.tokens,
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    plot(rows, Path(args.plot))
    for r in rows:
        print(f"{METHODS[r['method']]:32s} +{r['extra_capacity_percent']:3d}%  "
              f"time {r['time_vs_base']:.3f}x  loss {r['loss_vs_base']:.4f}x "
              f"({r['final_heldout_loss']:.4f})")
    print(f"written to {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
