"""Compute scavenging on the orchestrated path: extra learners join a running experiment and
leave it again, on the real Dagster daemon, against the same run without them.

    python benchmarks/scavenging_orchestrated.py            # three pairs, ~45 min on 2 cores
    python benchmarks/scavenging_orchestrated.py --runs 1   # one pair, ~15 min
    python benchmarks/scavenging_orchestrated.py --budget 1200000   # the earlier, short window

Two `diloco demo` runs of one config (the `tiny` model; every learner's inner step padded to
0.2 s, `orchestration.step_seconds_floor`, so four to eight learner processes emulate separate
machines on two cores instead of competing for them):
- base: 4 learners;
- +100%: a roster of 8, the last 4 on standby (`learners.standby`); a fault tape makes them join
  when the round at 25% of the base run's rounds opens and leave at 50% (`learner_join`,
  `learner_leave`, applied by the learner supervisor; `--window`).
The budget (`--budget`, 4.8M tokens) sets how long the window lasts: about two minutes of the
base run's eight. At 1.2M tokens it lasted 25-30 s, about as long as a joining learner's start
(launch, restore, compile) on the two shared cores, so the joiners left having barely trained
and the run could not show what the capacity buys.
For each: time from the first token to the token budget (STOP), the final model's loss on the
held-out test slice (100 batches over the whole held-out stream, `quality/store_scoring.py`;
the syncer's 16-batch eval kept beside it), rounds, the share of processed tokens that never
reached a merged version, and the learners' final statuses. The pair runs `--runs` times
(three by default: one orchestrated run's loss moves by a few percent with its schedule), and
each figure is reported as the median and range over the pairs, the loss ratio paired batch
by batch within a pair. The reference simulator runs both arms once (it is deterministic) on
the same config with the same window as fractions of the run (`simulation.capacity`), scored
on the same test slice, so the orchestrated ratios can be read against the simulated ones.
Writes `benchmarks/results/scavenging_orchestrated.json`.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.orchestration_demo import repeat_summary, score_demo, tokens_so_far  # noqa: E402
from pipelines.reporting import code_revision, machine_info  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "scavenging_orchestrated.json"
BASE, EXTRA = 4, 4
WINDOW = (0.25, 0.5)    # the extra learners' presence, as fractions of the base run's rounds
BUDGET = 4_800_000
COMMON = ["model.preset=tiny", "data.seq_len=64", "data.batch_size=8",
          "sync.sync_period=32", "sync.num_fragments=4",
          "sync.min_quorum=2", "sync.overlap_steps=2", "sync.grace_min_seconds=0.4",
          "orchestration.step_seconds_floor=0.2",
          # The same 16 held-out batches for the orchestrated evals and the simulator's.
          "orchestration.eval_batches=16", "simulation.eval_batches=16",
          "orchestration.checkpoint_every_steps=100",
          # Heartbeats (the syncer's view of each learner's tokens) every ~1 step, not the
          # launch defaults' 2 s (10 steps here): a round opens once K learners each made H/P
          # = 8 steps since the last opened, and 10-step jumps in what the syncer sees open
          # rounds every ~5 steps instead (`docs/orchestration.md`, Rounds).
          "orchestration.heartbeat_seconds=0.25"]


def arm_overrides(extra: int, budget: int) -> list[str]:
    m = BASE + extra
    return [*COMMON, f"token_budget={budget}", f"name=scavenge-{extra}",
            f"learners.num_learners={m}",
            "learners.speeds=[" + ", ".join(["1.0"] * m) + "]",
            f"learners.standby={extra}"]


def window_rounds(budget: int, window: tuple[float, float]) -> tuple[int, int]:
    """The rounds at which the extra learners join and leave: `window` of the base run's rounds
    (its expected rounds before the final ones)."""
    from pipelines.commands.cli import load_config

    base = load_config(None, arm_overrides(0, budget), base=_launch_defaults())
    rounds = base.expected_rounds - base.sync.num_fragments
    return int(window[0] * rounds), int(window[1] * rounds)


def tape(extra: int, joins: int, leaves: int) -> dict:
    names = [f"learner-{BASE + i}" for i in range(extra)]
    return {"faults": [
        *({"id": f"join-{n}", "kind": "learner_join", "learner": n, "at_round": joins}
          for n in names),
        *({"id": f"leave-{n}", "kind": "learner_leave", "learner": n, "at_round": leaves}
          for n in names)]}


def run_arm(extra: int, budget: int, workdir: Path, joins: int, leaves: int) -> dict:
    out = workdir / "summary.json"
    command = [sys.executable, "-m", "pipelines.commands.cli", "demo",
               "--workdir", str(workdir / "demo"),
               "--json", str(out), "--set",
               f"orchestration.compilation_cache_dir={workdir / 'jax-cache'}"]
    for override in arm_overrides(extra, budget):
        command += ["--set", override]
    if extra:
        path = workdir / "tape.json"
        path.write_text(json.dumps(tape(extra, joins, leaves)))
        command += ["--fault-tape", str(path)]
    progress: list[tuple[float, int]] = []
    started = time.monotonic()
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            progress.append((time.monotonic() - started,
                             tokens_so_far(workdir / "demo" / "store")))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = subprocess.run(command, cwd=REPO).returncode
    stop.set()
    sampler.join()
    if code != 0:
        raise SystemExit(f"diloco demo failed with exit code {code}")
    s = json.loads(out.read_text())
    test = score_demo(workdir)      # before the temporary directory goes
    first = next(t for t, n in progress if n > 0)
    budget = next((t for t, n in progress if n >= s["token_budget"]), progress[-1][0])
    ledger = s["ledger"]
    return {"extra_learners": extra, "seconds_first_token_to_budget": budget - first,
            "wall_seconds": s["wall_seconds"], "final_eval_loss": s["final_eval_loss"],
            "test_slice": test, "rounds_merged": s["rounds_merged"], "tokens": s["tokens"],
            "merged_fraction": ledger["merged_fraction"],
            "never_merged_fraction": (None if ledger["merged_fraction"] is None
                                      else 1 - ledger["merged_fraction"]),
            "left_before_offer_tokens": ledger["tokens"]["left_before_offer"],
            "ledger_balanced": ledger["balanced"], "ledger_exact": ledger["exact"],
            "capacity_changes": [(c["learner"], c["action"], c.get("round"))
                                 for c in s["capacity"]["changes"]],
            "learner_status": s["learner_status"],
            "learner_started_from": s["learner_started_from"]}


def simulate(extra: int, budget: int, window: tuple[float, float]) -> dict:
    from benchmarks.quality.scoring import DEFAULT_SIZES, score_slices
    from diloco_core.eval_slices import TEST
    from diloco_core.simulator import run_simulation
    from pipelines.commands.cli import load_config
    from resources.corpus import load_corpus

    overrides = arm_overrides(extra, budget)
    if extra:
        windows = ", ".join(f"{{learner: {BASE + i}, join: {window[0]}, leave: {window[1]}}}"
                            for i in range(extra))
        overrides.append(f"simulation.capacity=[{windows}]")
    cfg = load_config(None, overrides, base=_launch_defaults())
    corpus = load_corpus(cfg.data.corpus, cfg.learners.num_learners, cfg.data.heldout_fraction)
    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    s = result.summary()
    test = score_slices(cfg, result.final_params, corpus.heldout_stream, DEFAULT_SIZES)[TEST]
    return {"extra_learners": extra, "simulated_seconds": s["wall_seconds"],
            "final_heldout_loss": s["final_heldout_loss"], "test_slice": test,
            "rounds_merged": s["rounds_merged"]}


def _launch_defaults() -> list[str]:
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS

    return list(ORCHESTRATED_DEFAULTS)


# Each pair's figures, summarised as median and range over the pairs.
REPEAT_FIGURES = {
    "time_vs_base": ("time_vs_base",),
    "test_loss_vs_base": ("test_loss_vs_base", "ratio"),
    "eval_loss_vs_base": ("eval_loss_vs_base",),
    "base_seconds_first_token_to_budget": ("orchestrated", 0, "seconds_first_token_to_budget"),
    "extra_seconds_first_token_to_budget": ("orchestrated", 1, "seconds_first_token_to_budget"),
    "base_test_loss": ("orchestrated", 0, "test_slice", "loss"),
    "extra_test_loss": ("orchestrated", 1, "test_slice", "loss"),
    "base_never_merged_fraction": ("orchestrated", 0, "never_merged_fraction"),
    "extra_never_merged_fraction": ("orchestrated", 1, "never_merged_fraction"),
    "base_rounds_merged": ("orchestrated", 0, "rounds_merged"),
    "extra_rounds_merged": ("orchestrated", 1, "rounds_merged"),
}


def pair(base: dict, more: dict) -> dict:
    """The run with extra capacity against the base run of the same pair: time to the budget,
    and the test-slice loss paired batch by batch (the same batches for both)."""
    from benchmarks.quality.store_scoring import paired_difference

    return {"time_vs_base": (more["seconds_first_token_to_budget"]
                             / base["seconds_first_token_to_budget"]),
            "test_loss_vs_base": paired_difference(more["test_slice"]["batch_losses"],
                                                   base["test_slice"]["batch_losses"]),
            "eval_loss_vs_base": more["final_eval_loss"] / base["final_eval_loss"]}


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _without_batches(arm: dict) -> dict:
    """An arm's record for the result file: the test slice's per-batch losses dropped (the
    paired ratio keeps what they say)."""
    test = {k: v for k, v in arm["test_slice"].items() if k != "batch_losses"}
    return {**arm, "test_slice": test}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3,
                        help="pairs of runs (base, extra capacity); figures are their medians")
    parser.add_argument("--budget", type=int, default=BUDGET,
                        help="tokens per run; with --window, how long the extra learners stay")
    parser.add_argument("--window", type=float, nargs=2, default=WINDOW,
                        metavar=("JOIN", "LEAVE"),
                        help="when the extra learners join and leave, as fractions of the "
                             "base run's rounds")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    if not 0 <= args.window[0] < args.window[1] <= 1:
        parser.error(f"--window: want 0 <= JOIN < LEAVE <= 1, got {args.window}")
    window = tuple(args.window)
    revision = code_revision()
    joins, leaves = window_rounds(args.budget, window)
    pairs = []
    for run in range(args.runs):
        arms = []
        with tempfile.TemporaryDirectory() as tmp:
            for extra in (0, EXTRA):
                workdir = Path(tmp) / f"extra-{extra}"
                workdir.mkdir()
                arms.append(run_arm(extra, args.budget, workdir, joins, leaves))
        pairs.append({"run": run, **pair(*arms), "orchestrated": arms})
        p = pairs[-1]
        print(f"pair {run}: time {p['time_vs_base']:.3f}x, test loss "
              f"{p['test_loss_vs_base']['ratio']:.4f}x "
              f"(± {p['test_loss_vs_base']['ratio_standard_error']:.4f})", flush=True)
    sims = [simulate(extra, args.budget, window) for extra in (0, EXTRA)]
    from benchmarks.quality.store_scoring import paired_difference

    result = {
        "benchmark": "scavenging_orchestrated",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(), **revision,
        "command": " ".join(["python benchmarks/scavenging_orchestrated.py", *sys.argv[1:]]),
        "config": {"common": COMMON, "launch_defaults": _launch_defaults(),
                   "base_learners": BASE, "extra_learners": EXTRA,
                   "token_budget": args.budget, "window_fraction_of_base_rounds": window,
                   "join_round": joins, "leave_round": leaves},
        "summary": repeat_summary(pairs, REPEAT_FIGURES),
        "pairs": [{**p, "orchestrated": [_without_batches(a) for a in p["orchestrated"]]}
                  for p in pairs],
        "simulator": [_without_batches(sim) for sim in sims],
        "simulator_time_vs_base": sims[1]["simulated_seconds"] / sims[0]["simulated_seconds"],
        "simulator_test_loss_vs_base": paired_difference(sims[1]["test_slice"]["batch_losses"],
                                                         sims[0]["test_slice"]["batch_losses"]),
        "simulator_eval_loss_vs_base": (sims[1]["final_heldout_loss"]
                                        / sims[0]["final_heldout_loss"]),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for p in pairs:
        for a in p["orchestrated"]:
            print(f"pair {p['run']}, +{a['extra_learners']} learners: "
                  f"{a['seconds_first_token_to_budget']:.0f}s to the budget, test loss "
                  f"{a['test_slice']['loss']:.4f}, {a['rounds_merged']} merges, never merged "
                  f"{_share(a['never_merged_fraction'])}, changes {a['capacity_changes']}")
    for sim in sims:
        print(f"simulator +{sim['extra_learners']}: {sim['simulated_seconds']:.0f}s, test loss "
              f"{sim['test_slice']['loss']:.4f}")
    for name, row in result["summary"].items():
        print(f"  {name}: median {row['median']}, range {row['min']} - {row['max']}")
    print(f"simulator: time {result['simulator_time_vs_base']:.3f}x, test loss "
          f"{result['simulator_test_loss_vs_base']['ratio']:.4f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
