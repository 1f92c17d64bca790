"""Compute scavenging: extra learners join a run for a while, as reclaimable capacity does.

    python benchmarks/scavenging.py [--tokens 500000] [--extras 0 1 2 4 12] [--seeds 0 1 2]
        [--params 12e9] [--inter-site-gbps 100] [--step-seconds 1] [--window-seconds 7200]
        [--start-seconds 12.5] [--restart-seconds 600] [--set outer.lr=...]
        [--outer-lrs 0.3 0.5 0.7] [--inner-lrs 0.006 0.009] [--selection-seeds 0 1 2]
        [--workers 2]

A base of 4 learners trains the embedded default experiment (`small`, Decoupled DiLoCo with
K = 1 and the grace window) to a token budget; extra capacity of +25%, +50%, +100% and +300%
(1, 2, 4 and 12 more learners of the same speed) is there for the middle half of the run (from
25% to 75% of its nominal length). Decoupled DiLoCo takes each extra learner in as it comes (the
global parameters and a peer's AdamW state, its own unread data shard) and lets it go without
waiting for it; data-parallel uses it as an elastic global batch.

The capacity is in another site, and each method pays what it would pay at the scale the
options describe (issue 38: the simulation used to charge data-parallel nothing for it):

- data-parallel: while the remote capacity is in its batch, every step all-reduces the whole
  model's gradients over the inter-site link, as the bandwidth planner counts it (two sites,
  a bandwidth-optimal ring, bf16 gradients: `--params` x 2 bytes each way, at
  `--inter-site-gbps`), and the step waits for it; each join and each leave restarts the whole
  job to re-shard its batch (`--restart-seconds`: relaunch, checkpoint restore, compile);
- Decoupled DiLoCo: a joining learner trains only after its start-up (`--start-seconds`, by
  default what the orchestrated scavenging run measured for a join at 1.2M tokens: launch,
  restore, compile, 10-15 s; at 4.8M it measured 15-20 s from the round that admitted it,
  a difference of 0.1% of a two-hour window);
  its fragments' traffic overlaps its inner steps (the planner: well within one step at these
  link speeds), so its steps do not wait.

Times on the simulator's clock are scaled so that the capacity window is `--window-seconds`
of `--step-seconds` steps: the all-reduce is a share of a step, start-up and restarts a share
of the window. For each method and seed: time to the budget and the final loss on the held-out
test slice, against the same method without extra capacity; the ratios' mean and standard
error over seeds.

Each level's settings can be chosen as the quality experiments choose theirs (issue 38): with
`--outer-lrs` (Decoupled DiLoCo's outer lr) and `--inner-lrs` (data-parallel's lr, the baseline
tuned as hard as the method), every candidate runs at every level on `--selection-seeds`, the
one with the lowest mean validation-slice loss is that level's, and the figures reported are
those runs' on `--seeds` (fresh seeds: confirmation) and the test slice. The joiners change M
for half the run, and the outer lr chosen at M = 4 need not be the larger M's. Runs go through
the quality runner (`benchmarks/quality/runner.py`), so each
is stored with the code hash and commit that computed it and reused while the code is
unchanged. Writes `benchmarks/results/scavenging.json` and `docs/img/scavenging.png`.
"""

import argparse
import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.quality.experiments import DATA_PARALLEL, DECOUPLED, Arm  # noqa: E402
from benchmarks.quality.scoring import mean_and_standard_error  # noqa: E402
from diloco_core.bandwidth import plan_bandwidth  # noqa: E402
from pipelines.reporting import code_revision, machine_info  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "scavenging.json"
PLOT = REPO / "docs" / "img" / "scavenging.png"
BASE_LEARNERS = 4
WINDOW = (0.25, 0.75)          # the extra capacity's presence, as fractions of the run
METHODS = {DECOUPLED: "Decoupled DiLoCo", DATA_PARALLEL: "data-parallel (elastic batch)"}
# The setting chosen per capacity level when candidates are given, and the option that gives
# them: the method's step size against the work a round (or a step) merges.
TUNED = {DECOUPLED: ("outer.lr", "outer_lrs"), DATA_PARALLEL: ("inner.lr", "inner_lrs")}


def prices(args, window_sim_seconds: float, sim_step_seconds: float) -> dict[str, float]:
    """What the remote capacity costs each method, on the simulator's clock: the all-reduce as
    a share of a step (the planner's data-parallel transfer over the inter-site link between
    two sites), start-up and restarts as a share of the capacity window."""
    plan = plan_bandwidth(args.params, sites=2, sync_period=1, num_fragments=1,
                          overlap_steps=0, step_seconds=args.step_seconds)["data_parallel"]
    allreduce_real = plan.bytes_per_step * 8 / (args.inter_site_gbps * 1e9)
    window_steps_real = args.window_seconds / args.step_seconds
    per_real_step = window_sim_seconds / window_steps_real   # simulated seconds a real step
    return {"capacity_allreduce_seconds": allreduce_real / args.step_seconds * sim_step_seconds,
            "capacity_start_seconds": args.start_seconds / args.step_seconds * per_real_step,
            "capacity_restart_seconds": args.restart_seconds / args.step_seconds
            * per_real_step,
            "allreduce_real_seconds": allreduce_real,
            "allreduce_bytes_per_step": plan.bytes_per_step}


def arm(method: str, extra: int, tokens: int, seed: int, priced: dict[str, float],
        extra_overrides: tuple[str, ...] = ()) -> Arm:
    overrides = [f"learners.num_learners={BASE_LEARNERS + extra}", *extra_overrides]
    if extra:
        windows = ", ".join(f"{{learner: {BASE_LEARNERS + i}, join: {WINDOW[0]}, "
                            f"leave: {WINDOW[1]}}}" for i in range(extra))
        overrides.append(f"simulation.capacity=[{windows}]")
        overrides += [f"simulation.{name}={priced[name]:.6g}" for name in (
            "capacity_start_seconds", "capacity_allreduce_seconds", "capacity_restart_seconds")]
    return Arm(f"+{100 * extra // BASE_LEARNERS}% capacity", method, tuple(overrides), seed,
               tokens)


def candidates(args) -> dict[str, list[float]]:
    """Each tuned method's candidate values: today's and its option's, once each."""
    from benchmarks.quality.runner import arm_config

    today = arm_config(arm(DECOUPLED, 0, args.tokens, 0, {}, tuple(args.set)))
    found = {}
    for method, (field, option) in TUNED.items():
        section, name = field.split(".")
        # Today's value is always a candidate: a level keeps it unless another does better.
        found[method] = sorted({getattr(getattr(today, section), name), *getattr(args, option)})
    return found


def uneven_tuning(found: dict[str, list[float]]) -> str | None:
    """Why the candidates tune one method harder than the other, or None: issue 38 gives the
    baseline at least the method's budget of configurations, and an option that repeats
    today's value (`--inner-lrs 0.008` where 8e-3 is the default) silently gives it one
    fewer; tuning one method alone is uneven too."""
    counts = {method: len(values) for method, values in found.items()}
    if len(set(counts.values())) < 2 or max(counts.values()) < 2:
        return None
    return ("--outer-lrs / --inner-lrs: the methods get "
            + ", ".join(f"{len(v)} candidates ({', '.join(f'{x:g}' for x in v)}) for "
                        f"{METHODS[m]}" for m, v in found.items())
            + " (today's value counts once): give each as many, so that neither is tuned "
              "harder")


def choose_settings(args, priced: dict[str, float], run) -> tuple[dict, list[dict]]:
    """Per method with candidates, per capacity level: the candidate with the lowest mean
    validation-slice loss over the selection seeds. `run(arms)` returns their records by arm.
    Returns ({(method, extra): override}, the selection table)."""
    arms = {}
    for method, values in candidates(args).items():
        field = TUNED[method][0]
        if len(values) < 2:
            continue
        for extra in args.extras:
            for value in values:
                for seed in args.selection_seeds:
                    arms[method, extra, value, seed] = arm(
                        method, extra, args.tokens, seed, priced, (*args.set, f"{field}={value}"))
    records = run(list(arms.values()))
    chosen, table = {}, []
    for method, extra in sorted({(m, e) for m, e, _, _ in arms}):
        field = TUNED[method][0]
        scores = {}
        for (m, e, value, _), one in arms.items():
            if (m, e) == (method, extra):
                scores.setdefault(value, []).append(
                    records[one]["heldout_slices"]["validation"]["loss"])
        means = {value: statistics.fmean(losses) for value, losses in scores.items()}
        best = min(means, key=means.get)
        chosen[method, extra] = f"{field}={best}"
        table.append({"method": method, "extra_learners": extra, "field": field,
                      "validation_loss_by_value": {str(v): round(x, 4) for v, x in means.items()},
                      "chosen": best})
    return chosen, table


def summarise(rows: list[dict]) -> list[dict]:
    """Per method and level: the ratios to the same method and seed without extra capacity,
    mean and standard error over seeds."""
    out = []
    for method in METHODS:
        for extra in sorted({r["extra_learners"] for r in rows}):
            mine = [r for r in rows if r["method"] == method and r["extra_learners"] == extra]
            time_mean, time_se = mean_and_standard_error([r["time_vs_base"] for r in mine])
            loss_mean, loss_se = mean_and_standard_error([r["loss_vs_base"] for r in mine])
            out.append({"method": method, "extra_learners": extra,
                        "extra_capacity_percent": mine[0]["extra_capacity_percent"],
                        "setting": mine[0]["setting"],
                        "seeds": [r["seed"] for r in mine],
                        "wall_seconds": round(statistics.fmean(
                            r["wall_seconds"] for r in mine), 2),
                        "test_loss": round(statistics.fmean(r["test_loss"] for r in mine), 4),
                        "time_vs_base": round(time_mean, 4),
                        "time_vs_base_se": None if time_se is None else round(time_se, 4),
                        "loss_vs_base": round(loss_mean, 4),
                        "loss_vs_base_se": None if loss_se is None else round(loss_se, 4)})
    return out


def plot(summary: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for method, label in METHODS.items():
        mine = sorted((r for r in summary if r["method"] == method),
                      key=lambda r: r["extra_capacity_percent"])
        xs = [r["extra_capacity_percent"] for r in mine]
        for ax, name in ((time_ax, "time_vs_base"), (loss_ax, "loss_vs_base")):
            ax.errorbar(xs, [r[name] for r in mine], yerr=[r[f"{name}_se"] or 0 for r in mine],
                        marker="o", capsize=3, label=label)
    time_ax.set_ylabel("time to the token budget / without extra capacity")
    loss_ax.set_ylabel("test-slice loss / without extra capacity")
    for ax in (time_ax, loss_ax):
        ax.set_xlabel("extra capacity in another site, middle half of the run (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Compute scavenging: 4 learners plus remote capacity that comes and goes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_path(out: str, plot: str | None) -> Path:
    """Where a run's plot goes: the docs' figure only for the headline result, so that a probe
    written elsewhere with `--out` does not overwrite the figure the docs show."""
    if plot:
        return Path(plot)
    return PLOT if Path(out).resolve() == OUT.resolve() else Path(out).with_suffix(".png")


def _se(value: float | None) -> str:
    return f" ± {value:.4f}" if value is not None else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=500_000)
    parser.add_argument("--extras", type=int, nargs="+", default=[0, 1, 2, 4, 12],
                        help="extra learners (0 is the base run every ratio refers to)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--params", type=float, default=12e9,
                        help="the modelled model's parameters (the all-reduce's size)")
    parser.add_argument("--inter-site-gbps", type=float, default=100.0,
                        help="the link between the base site and the scavenged capacity")
    parser.add_argument("--step-seconds", type=float, default=1.0,
                        help="an inner step's compute time at the modelled scale")
    parser.add_argument("--window-seconds", type=float, default=7200.0,
                        help="how long the scavenged capacity stays, in real seconds")
    parser.add_argument("--start-seconds", type=float, default=12.5,
                        help="a Decoupled DiLoCo joiner's start-up (the orchestrated runs: "
                             "10-15 s, and 15-20 s from the admitting round at 4.8M)")
    parser.add_argument("--restart-seconds", type=float, default=600.0,
                        help="a data-parallel job's restart at a join or leave (relaunch, "
                             "checkpoint restore, compile)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a config override for every arm (e.g. the outer lr for larger M)")
    parser.add_argument("--outer-lrs", type=float, nargs="+", default=[],
                        help="candidates for Decoupled DiLoCo's outer lr, chosen per level on "
                             "the selection seeds' validation slice (today's always one)")
    parser.add_argument("--inner-lrs", type=float, nargs="+", default=[],
                        help="candidates for data-parallel's lr, chosen the same way")
    parser.add_argument("--selection-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=1,
                        help="arms run in this many processes at once")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--plot", help="where the plot goes (default: docs/img/scavenging.png "
                                         "for the default --out, else beside --out)")
    parser.add_argument("--runs-dir", help="where runs are stored (default: the quality runs)")
    args = parser.parse_args()
    args.plot = str(plot_path(args.out, args.plot))
    if 0 not in args.extras:
        parser.error("--extras must include 0, the base run")
    if (args.outer_lrs or args.inner_lrs) and set(args.seeds) & set(args.selection_seeds):
        parser.error("--seeds must be fresh seeds, none of --selection-seeds, when settings "
                     "are chosen (selection apart from confirmation)")
    if (args.outer_lrs or args.inner_lrs) and (why := uneven_tuning(candidates(args))):
        parser.error(why)
    from benchmarks.quality.parallel import run_arms
    from benchmarks.quality.runner import RUNS_DIR, arm_config, arm_key

    runs_dir = Path(args.runs_dir) if args.runs_dir else RUNS_DIR
    base_cfg = arm_config(arm(DECOUPLED, 0, args.tokens, 0, {}, tuple(args.set)))
    window_sim = (WINDOW[1] - WINDOW[0]) * base_cfg.nominal_run_seconds
    priced = prices(args, window_sim, base_cfg.simulation.step_seconds)
    revision = code_revision()   # before the runs: the code they ran

    tuned_fields = {field for field, _ in TUNED.values()}

    def done(a: Arm, record: dict) -> None:
        setting = next((o for o in a.overrides if o.split("=")[0] in tuned_fields), "")
        print(f"  {METHODS[a.method]} {a.label} seed {a.seed} {setting}: validation "
              f"{record['heldout_slices']['validation']['loss']:.4f}, test "
              f"{record['heldout_slices']['test']['loss']:.4f} ({record['compute_seconds']} s)",
              flush=True)

    def run(arms: list[Arm]) -> dict[Arm, dict]:
        by_key = run_arms(arms, runs_dir, workers=args.workers, on_done=done)
        return {a: by_key[arm_key(a)] for a in arms}

    chosen, selection = choose_settings(args, priced, run)
    for row in selection:
        print(f"{METHODS[row['method']]:32s} +{100 * row['extra_learners'] // BASE_LEARNERS:3d}%"
              f"  {row['field']} {row['chosen']} (validation {row['validation_loss_by_value']})")
    plan = {(method, extra, seed): arm(method, extra, args.tokens, seed, priced, tuple(
                args.set) + ((chosen[method, extra],) if (method, extra) in chosen else ()))
            for seed in args.seeds for extra in sorted(args.extras) for method in METHODS}
    records = run(list(plan.values()))
    rows = []
    for (method, extra, seed), one in plan.items():
        record = records[one]
        summary = record["summary"]
        rows.append({"method": method, "seed": seed, "extra_learners": extra,
                     "extra_capacity_percent": 100 * extra // BASE_LEARNERS,
                     "setting": chosen.get((method, extra)),
                     "wall_seconds": summary["wall_seconds"],
                     "test_loss": record["heldout_slices"]["test"]["loss"],
                     "first_8kb_loss": summary["final_heldout_loss"],
                     "tokens": summary["tokens_processed"],
                     "run": record["key"], "run_commit": record["commit"]})
    for row in rows:
        base = next(r for r in rows if r["method"] == row["method"] and r["seed"] == row["seed"]
                    and r["extra_learners"] == 0)
        row["time_vs_base"] = round(row["wall_seconds"] / base["wall_seconds"], 4)
        row["loss_vs_base"] = round(row["test_loss"] / base["test_loss"], 4)
    summary = summarise(rows)
    result = {"benchmark": "scavenging", "when": datetime.now(UTC).isoformat(timespec="seconds"),
              **revision, "machine": machine_info(),
              "command": "python benchmarks/scavenging.py " + " ".join(sys.argv[1:]),
              "base_learners": BASE_LEARNERS, "window": list(WINDOW), "tokens": args.tokens,
              "scenario": {"params": args.params, "inter_site_gbps": args.inter_site_gbps,
                           "step_seconds": args.step_seconds,
                           "window_seconds": args.window_seconds,
                           "start_seconds": args.start_seconds,
                           "restart_seconds": args.restart_seconds, "overrides": args.set},
              "selection": {"seeds": args.selection_seeds, "slice": "validation",
                            "rule": "per method and level, the candidate with the lowest mean "
                                    "validation-slice loss over the selection seeds",
                            "levels": selection} if selection else None,
              "prices_on_the_simulator_clock": {k: round(v, 6) for k, v in priced.items()},
              "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    plot(summary, Path(args.plot))
    print(f"data-parallel's all-reduce: {priced['allreduce_real_seconds']:.2f} s a "
          f"{args.step_seconds:g} s step ({priced['capacity_allreduce_seconds']:.3f} on the "
          f"simulator's clock); start-up {priced['capacity_start_seconds']:.3f}, restart "
          f"{priced['capacity_restart_seconds']:.3f} simulated seconds")
    for r in summary:
        print(f"{METHODS[r['method']]:32s} +{r['extra_capacity_percent']:3d}%  "
              f"time {r['time_vs_base']:.3f}x{_se(r['time_vs_base_se'])}  "
              f"loss {r['loss_vs_base']:.4f}x{_se(r['loss_vs_base_se'])} ({r['test_loss']:.4f}, "
              f"seeds {r['seeds']})")
    print(f"written to {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
