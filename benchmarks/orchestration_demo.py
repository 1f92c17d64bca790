"""The orchestrated demo, measured: wall time, learner idle fraction, merge latency, memory, and
throughput against the in-process reference simulator on the same config.

1. `diloco demo` (the README's main command) with its embedded defaults, optionally `--chaos`,
   while a sampler records the memory of every process of the run (dagster dev, daemon,
   code server, run workers, learners, the syncer) once a second: PSS, which sums to the
   physical memory the run uses, and RSS, which counts shared libraries once per process.
2. The in-process reference simulator (`diloco_core.simulator.run_simulation`) on the same
   experiment config: same model, data, M, H, P, K and token budget, one process, fake clock.

Throughput = tokens processed / wall seconds; merge latency = quorum reached -> new global
version published (the grace window, the decision and the merge); decision -> published = the
merge alone (the syncer service's, or a fallback merge run's); the loss is the final global
model's on the held-out test slice (100 batches over the whole held-out stream, as the quality
experiments score; the syncer's own 4-batch eval is kept beside it), against each simulator
run's on the same batches; never merged = the share of
processed tokens that reached no merged version, for any reason (the token ledger's fates other
than `merged`: late or refused offers, offers in flight at the end, progress a stopped or dead
learner never offered, and progress overwritten on receipt). Superseded on receipt (the last
of those) is kept as a detail: under the rebase receive rule, today's default, it is zero by
construction, so it is no figure of merit.

    python benchmarks/orchestration_demo.py            # ~20 min on 2 cores
    python benchmarks/orchestration_demo.py --chaos
    python benchmarks/orchestration_demo.py --runs 3   # three repeats: medians and ranges
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))     # benchmarks.quality, for the test slice
DEFAULT_OUT = REPO / "benchmarks" / "results" / "orchestration_demo.json"


# Which part of the run a process is, from its command line (first match wins).
ROLES = (("learner", "pipelines.learner_entry"), ("syncer", "pipelines.syncer.entry"),
         ("run worker", "multiprocessing.spawn"), ("code server", "dagster api grpc"),
         ("code server", "dagster code-server"), ("webserver", "dagster_webserver"),
         ("daemon", "dagster._daemon"), ("dagster dev", "dagster dev"),
         ("demo command", "pipelines.commands.cli demo"))


def _role(cmdline: str, roles=ROLES) -> str:
    return next((role for role, marker in roles if marker in cmdline), "other")


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB. PSS charges each shared page to the processes that map
    it in equal parts, so PSS sums to the physical memory of a process tree; RSS counts a page
    once per process (the JAX and Dagster libraries every process maps), an upper bound."""
    rss = pss = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


def process_tree(root_pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of a process and all its descendants (from /proc's parent links);
    a process that exits meanwhile is left out."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                tree.append((pid, f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:  # exited meanwhile
            continue
    return tree


def memory_snapshot(root_pid: int, roles=ROLES) -> dict:
    """RSS and PSS of a process and all its descendants (from /proc), in MiB, in total and
    by role (learners, syncer, Dagster's run workers, code server, webserver, daemon; `roles`
    as `ROLES`)."""
    by_role: dict[str, dict[str, float]] = {}
    for pid, cmdline in process_tree(root_pid):
        try:
            rss, pss = _memory_kib(pid)
        except (OSError, ValueError):  # exited meanwhile
            continue
        row = by_role.setdefault(_role(cmdline, roles),
                                 {"processes": 0, "rss_mib": 0.0, "pss_mib": 0.0})
        row["processes"] += 1
        row["rss_mib"] += rss / 1024
        row["pss_mib"] += pss / 1024
    return {"rss_mib": sum(r["rss_mib"] for r in by_role.values()),
            "pss_mib": sum(r["pss_mib"] for r in by_role.values()),
            "by_role": dict(sorted(by_role.items(), key=lambda kv: -kv[1]["pss_mib"]))}


def tokens_so_far(store_dir: Path) -> int:
    """Tokens the learners have processed, from their heartbeats in the local store."""
    total = 0
    for path in store_dir.glob("experiments/*/learners/*/heartbeat.json"):
        try:
            total += int(json.loads(path.read_text()).get("tokens_total", 0))
        except (OSError, ValueError, TypeError):
            continue     # being rewritten: the next sample reads it
    return total


def steady_throughput(progress: list[tuple[float, int]], budget: int) -> dict:
    """Tokens per second between 10% and 90% of the budget (the start, Dagster's and every
    process's, and the final rounds left out), and the seconds from the demo command's start
    to the first token."""
    def first_at(level: float) -> tuple[float, int] | None:
        return next(((t, n) for t, n in progress if n >= level), None)

    started = first_at(1)
    low, high = first_at(0.1 * budget), first_at(0.9 * budget)
    reached = first_at(budget)
    if low is None or high is None or high[0] <= low[0]:
        return {"tokens_per_second": None, "seconds_to_first_token": None,
                "seconds_to_budget": None}
    return {"tokens_per_second": (high[1] - low[1]) / (high[0] - low[0]),
            "seconds_to_first_token": started[0] if started else None,
            # The learners' heartbeats reach the budget; after it: the final rounds, the
            # learners' last checkpoints and the summary.
            "seconds_to_budget": reached[0] if reached else None}


def learner_starts(store_dir: Path, command_started: float) -> list[float]:
    """Seconds from the demo command's start to each learner process's start (their latest
    attempts: the first, in a run without faults)."""
    starts = []
    for path in sorted(store_dir.glob("experiments/*/learners/*/heartbeat.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            at = json.loads(path.read_text()).get("started_at")
            if at:
                starts.append(round(float(at) - command_started, 1))
    return starts


def run_demo(chaos: bool, workdir: Path, overrides: list[str]
             ) -> tuple[dict, dict, list[tuple[float, int]]]:
    out = workdir / "summary.json"
    # An empty compilation cache, as on a fresh machine (the learners and the syncer compile
    # cold; a relaunched process reuses what this run compiled).
    command = [sys.executable, "-m", "pipelines.commands.cli", "demo",
               "--workdir", str(workdir / "demo"),
               "--json", str(out), "--set",
               f"orchestration.compilation_cache_dir={workdir / 'jax-cache'}"
               ] + [arg for o in overrides for arg in ("--set", o)] + (
                   ["--chaos"] if chaos else [])
    command_started = time.time()
    process = subprocess.Popen(command, cwd=REPO)
    # The sample with the largest PSS total (the breakdown is of that instant) and the
    # largest RSS total seen, which may come at another instant.
    peak = {"pss_mib": 0.0, "rss_mib": 0.0, "by_role": {}}
    max_rss = 0.0
    progress: list[tuple[float, int]] = []     # (seconds since the command started, tokens)
    started = time.monotonic()
    stop = threading.Event()

    def sample():
        nonlocal peak, max_rss
        while not stop.is_set():
            progress.append((time.monotonic() - started,
                             tokens_so_far(workdir / "demo" / "store")))
            snap = memory_snapshot(process.pid)
            max_rss = max(max_rss, snap["rss_mib"])
            if snap["pss_mib"] > peak["pss_mib"]:
                peak = snap
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = process.wait()
    stop.set()
    sampler.join()
    if code != 0:
        raise SystemExit(f"diloco demo failed with exit code {code}")
    demo = json.loads(out.read_text())
    demo["learner_process_started_seconds"] = learner_starts(workdir / "demo" / "store",
                                                             command_started)
    return demo, {"peak_pss_mib": peak["pss_mib"], "peak_rss_mib": max_rss,
                  "at_peak_pss": peak}, progress


def clock_calibration(store_dir: Path, config_path: Path, demo: dict) -> dict:
    """The simulator's fake clock set to what the demo measured, so that the two run the same
    schedule: each learner's seconds per inner step (its training time over its steps, from
    its last heartbeat; the fastest sets `step_seconds`, the others their `speeds`), and the
    decision -> arrival latency (the median decision -> published plus half the learners'
    poll interval, the mean wait before a learner sees a new version)."""
    per_step = {}
    for path in sorted(store_dir.glob("experiments/*/learners/*/heartbeat.json")):
        beat = json.loads(path.read_text())
        if beat.get("step") and beat.get("training_seconds"):
            per_step[beat["learner"]] = beat["training_seconds"] / beat["step"]
    cfg = _config(config_path)
    names = cfg.learners.learner_names
    fastest = min(per_step.values())
    poll = cfg.orchestration.poll_seconds
    sync = demo["decision_to_publish_seconds"]["median"] + poll / 2
    speeds = [round(fastest / per_step[name], 3) for name in names]
    return {"simulation.step_seconds": round(fastest, 4),
            "simulation.sync_seconds": round(sync, 4),
            "learners.speeds": speeds}


def dagster_history(home: Path) -> dict:
    """What the run left in the Dagster instance (SQLite in DAGSTER_HOME): each job's runs by
    final status, and the instance's database files' bytes (runs, event logs, sensor ticks),
    which grow with every round the quorum sensor mirrors."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs: dict[str, dict[str, int]] = {}
        for run in instance.get_runs():
            by_status = runs.setdefault(run.job_name, {})
            by_status[run.status.value] = by_status.get(run.status.value, 0) + 1
    database = sum(p.stat().st_size for p in home.rglob("*.db"))
    return {"runs": runs, "database_bytes": database}


def _config(config_path: Path, overrides: list[str] = ()):
    from pipelines.commands.cli import load_config

    return load_config(str(config_path), list(overrides))


def run_reference(config_path: Path, overrides: list[str] = ()) -> dict:
    from benchmarks.quality.scoring import DEFAULT_SIZES, score_slices
    from diloco_core.eval_slices import TEST
    from diloco_core.simulator import run_simulation
    from resources.corpus import load_corpus

    cfg = _config(config_path, overrides)
    corpus = load_corpus(cfg.data.corpus, cfg.learners.num_learners, cfg.data.heldout_fraction)
    started = time.perf_counter()
    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    wall = time.perf_counter() - started
    s = result.summary()
    test = score_slices(cfg, result.final_params, corpus.heldout_stream, DEFAULT_SIZES)[TEST]
    return {"wall_seconds": wall, "tokens": s["tokens_processed"],
            "tokens_per_second": s["tokens_processed"] / wall,
            "final_heldout_loss": s["final_heldout_loss"], "rounds_merged": s["rounds_merged"],
            "test_slice": test}


def score_demo(workdir: Path) -> dict:
    """The demo's final global model on the held-out test slice (the quality experiments'
    100 batches over the whole held-out stream), read from its store before the temporary
    directory goes: the syncer's own eval is 4 batches at the start of the stream."""
    from benchmarks.quality.store_scoring import score_store
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store

    cfg = _config(workdir / "demo" / "experiment.yaml")
    return score_store(ArtifactStore(open_blob_store(str(workdir / "demo" / "store")), cfg.name))


def _test_ratio(demo_test: dict, reference: dict | None) -> dict | None:
    """The demo's test-slice loss over a reference's, batch by batch on the same batches."""
    if reference is None:
        return None
    from benchmarks.quality.store_scoring import paired_difference

    return paired_difference(demo_test["batch_losses"], reference["test_slice"]["batch_losses"])


def one_run(chaos: bool, revision: dict, command: str, overrides: list[str],
            references: bool = True) -> dict:
    """One demo and its two simulator references (none without `references`: the figures
    against them are then None), as one result record."""
    from pipelines.reporting import machine_info
    from pipelines.run_summary import latency_by_merger
    from resources.store.summary_records import RoundEntry

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        demo, memory, progress = run_demo(chaos, workdir, overrides)
        demo_test = score_demo(workdir)
        num_learners = _config(workdir / "demo" / "experiment.yaml").learners.num_learners
        dagster = dagster_history(workdir / "demo" / "dagster_home")
        reference = calibration = calibrated = None
        if references:
            reference = run_reference(workdir / "demo" / "experiment.yaml")
            calibration = clock_calibration(workdir / "demo" / "store",
                                            workdir / "demo" / "experiment.yaml", demo)
            calibrated = run_reference(
                workdir / "demo" / "experiment.yaml",
                [f"{k}={json.dumps(v)}" for k, v in calibration.items()])
    rounds = [RoundEntry.model_validate(r) for r in demo["rounds"]]
    lat = demo["merge_latency_seconds"]
    dec = demo["decision_to_publish_seconds"]
    ledger = demo["ledger"]
    processed = ledger["tokens_processed"]
    result = {
        "benchmark": "orchestration_demo",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        **revision,
        "command": command,
        "demo": {
            "wall_seconds": demo["wall_seconds"], "tokens": demo["tokens"],
            # The learners stop at the budget; what they trained past it (the rounds in
            # flight when it was reached) is the overshoot, the bar <= 2% at any M.
            "token_budget": demo["token_budget"],
            "budget_overshoot": demo["tokens"] / demo["token_budget"] - 1,
            "learners": num_learners,
            # Every run ended as it should (a shutdown under a run fails it), and what the
            # Dagster database holds per merged round.
            "dagster_runs": dagster["runs"],
            "dagster_database_bytes": dagster["database_bytes"],
            "dagster_database_bytes_per_round": dagster["database_bytes"] / max(
                1, demo["rounds_merged"]),
            "tokens_per_second": demo["tokens"] / demo["wall_seconds"],
            "rounds_merged": demo["rounds_merged"],
            "initial_eval_loss": demo["initial_eval_loss"],
            "final_eval_loss": demo["final_eval_loss"],
            "test_slice": {k: demo_test[k] for k in ("loss", "standard_error", "batches",
                                                     "batch_losses", "versions")},
            "learner_idle_fraction": demo["learner_idle_fraction"],
            "uptime": demo["uptime"],
            "merge_latency_median_seconds": lat["median"],
            "merge_latency_p90_seconds": lat["p90"],
            "decision_to_publish_median_seconds": dec["median"],
            "decision_to_publish_p90_seconds": dec["p90"],
            "never_merged_fraction": (1 - ledger["merged_fraction"]
                                      if ledger.get("merged_fraction") is not None else None),
            "superseded_on_receipt_fraction": (
                ledger["tokens"].get("superseded_on_receipt", 0.0) / processed
                if processed else None),
            "merged_by": demo["merged_by"],
            # Each percentile with the merges behind it: the service's own merges, and the
            # merge runs of the sensor's fallback (e.g. before the syncer holds its lease).
            "decision_to_publish_by_merger": {k: d.to_json() for k, d in latency_by_merger(
                rounds, "decision_to_publish_seconds").items()},
            "quorum_to_publish_by_merger": {k: d.to_json() for k, d in latency_by_merger(
                rounds, "quorum_to_publish_seconds").items()},
            "rounds": [{k: r.get(k) for k in ("round", "decided_by", "merged_by",
                                              "quorum_to_publish_seconds",
                                              "decision_to_publish_seconds")}
                       for r in demo["rounds"] if r.get("merged")],
            "peak_pss_mib": memory["peak_pss_mib"],
            "peak_rss_mib": memory["peak_rss_mib"],
            "memory_at_peak": memory["at_peak_pss"],
            "failures_injected": demo["failures_injected"],
            "learners_rejoined": demo["learners_rejoined"],
        },
        "reference_simulator": reference,
        # The same simulator with its clock set to the demo's measured step and merge times:
        # the comparison of the algorithm on the same schedule (the loss target's reference).
        "calibrated_clock": calibration,
        "reference_simulator_calibrated": calibrated,
    }
    steady = steady_throughput(progress, demo["token_budget"])
    result["demo"]["steady_tokens_per_second"] = steady["tokens_per_second"]
    result["demo"]["seconds_to_first_token"] = steady["seconds_to_first_token"]
    result["demo"]["seconds_to_budget"] = steady["seconds_to_budget"]
    result["demo"]["learner_process_started_seconds"] = demo["learner_process_started_seconds"]
    # End to end: the demo's whole wall time (Dagster's start, the job launch, every process's
    # imports and compilation, the final rounds and the summary) against the simulator's whole
    # run (its compilation included). Steady: between 10% and 90% of the budget, against the
    # same whole simulator run (so the ratio, if anything, favours the simulator).
    result["throughput_ratio_demo_to_reference"] = (
        None if reference is None
        else result["demo"]["tokens_per_second"] / reference["tokens_per_second"])
    result["steady_throughput_ratio_demo_to_reference"] = (
        None if steady["tokens_per_second"] is None or reference is None
        else steady["tokens_per_second"] / reference["tokens_per_second"])
    result["final_loss_ratio_demo_to_reference"] = (
        None if reference is None
        else result["demo"]["final_eval_loss"] / reference["final_heldout_loss"])
    result["final_loss_ratio_demo_to_calibrated_reference"] = (
        None if calibrated is None
        else result["demo"]["final_eval_loss"] / calibrated["final_heldout_loss"])
    # On the test slice (issue 38: 100 batches over the whole held-out stream, where the
    # syncer's eval above is its first 4), paired batch by batch.
    result["test_vs_reference"] = _test_ratio(demo_test, reference)
    result["test_vs_calibrated_reference"] = _test_ratio(demo_test, calibrated)
    return result


# The figures each repeat is summarised by (median and range over the runs): the bars
# (decision -> published, the loss against the calibrated simulator) and the run's shape.
REPEAT_FIGURES = {
    "wall_seconds": ("demo", "wall_seconds"),
    "rounds_merged": ("demo", "rounds_merged"),
    "budget_overshoot": ("demo", "budget_overshoot"),
    "dagster_database_bytes_per_round": ("demo", "dagster_database_bytes_per_round"),
    "final_eval_loss": ("demo", "final_eval_loss"),
    "decision_to_publish_median_seconds": ("demo", "decision_to_publish_median_seconds"),
    "decision_to_publish_p90_seconds": ("demo", "decision_to_publish_p90_seconds"),
    "merge_latency_median_seconds": ("demo", "merge_latency_median_seconds"),
    "learner_idle_fraction": ("demo", "learner_idle_fraction"),
    "uptime": ("demo", "uptime"),
    "never_merged_fraction": ("demo", "never_merged_fraction"),
    "superseded_on_receipt_fraction": ("demo", "superseded_on_receipt_fraction"),
    "peak_pss_mib": ("demo", "peak_pss_mib"),
    "test_loss": ("demo", "test_slice", "loss"),
    "test_loss_ratio_demo_to_calibrated_reference": ("test_vs_calibrated_reference", "ratio"),
    "test_loss_ratio_demo_to_reference": ("test_vs_reference", "ratio"),
    "final_loss_ratio_demo_to_calibrated_reference": (
        "final_loss_ratio_demo_to_calibrated_reference",),
    "final_loss_ratio_demo_to_reference": ("final_loss_ratio_demo_to_reference",),
    "steady_throughput_ratio_demo_to_reference": ("steady_throughput_ratio_demo_to_reference",),
}


def repeat_summary(results: list[dict], figures: dict = REPEAT_FIGURES) -> dict:
    """Each figure's value per run, median and range: one run's loss moves by about 3% with its
    schedule, so a claim about the demo is the median of repeats. `figures` names each figure's
    path of keys (or list indices) into a run's result."""
    summary = {}
    for name, path in figures.items():
        values = []
        for result in results:
            value = result
            for key in path:
                value = None if value is None else value[key]     # None: not measured
            values.append(value)
        present = [v for v in values if v is not None]
        summary[name] = {"runs": values,
                         "median": statistics.median(present) if present else None,
                         "min": min(present, default=None), "max": max(present, default=None)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chaos", action="store_true")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the demo and its references; the file keeps the last run's "
                             "details and every run's figures with their median and range")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="FIELD=VALUE",
                        help="passed to the demo (and so to its reference simulations), e.g. "
                             "learners.num_learners=1")
    parser.add_argument("--no-reference", action="store_true",
                        help="the demo alone, without its simulator references (e.g. for the "
                             "budget overshoot)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    from pipelines.reporting import code_revision

    revision = code_revision()     # the code that runs: taken before, not after, the runs
    command = ("python benchmarks/orchestration_demo.py" + (" --chaos" if args.chaos else "")
               + (f" --runs {args.runs}" if args.runs > 1 else "")
               + "".join(f" --set {o}" for o in args.overrides)
               + (" --no-reference" if args.no_reference else "")
               + (f" --out {args.out}" if args.out != str(DEFAULT_OUT) else ""))
    results = []
    for index in range(args.runs):
        results.append(one_run(args.chaos, revision, command, args.overrides,
                               references=not args.no_reference))
        print(f"run {index + 1} of {args.runs}:")
        _print_run(results[-1])
    result = results[-1]
    if args.runs > 1:
        result["repeats"] = repeat_summary(results)
        for name, row in result["repeats"].items():
            print(f"  {name}: median {row['median']}, range {row['min']} - {row['max']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"written to {args.out}")


def _print_run(result: dict) -> None:
    reference = result["reference_simulator"]
    calibration = result["calibrated_clock"]
    calibrated = result["reference_simulator_calibrated"]
    d = result["demo"]
    print(f"demo: {d['wall_seconds']:.0f}s wall, {d['tokens_per_second']:.0f} tok/s, "
          f"{d['rounds_merged']} merges, loss {d['initial_eval_loss']:.3f} -> "
          f"{d['final_eval_loss']:.3f}, idle {d['learner_idle_fraction']:.1%}, merge latency "
          f"median {d['merge_latency_median_seconds']:.1f}s p90 "
          f"{d['merge_latency_p90_seconds']:.1f}s, decision->published median "
          f"{d['decision_to_publish_median_seconds']:.3f}s p90 "
          f"{d['decision_to_publish_p90_seconds']:.3f}s, never merged "
          f"{d['never_merged_fraction']:.1%} (superseded on receipt "
          f"{d['superseded_on_receipt_fraction']:.1%}), peak memory {d['peak_pss_mib']:.0f} MiB "
          f"PSS ({d['peak_rss_mib']:.0f} MiB RSS)")
    for role, row in d["memory_at_peak"]["by_role"].items():
        print(f"  {role:12s} x{row['processes']:<2d} PSS {row['pss_mib']:6.0f} MiB, "
              f"RSS {row['rss_mib']:6.0f} MiB")
    for kind, dist in d["decision_to_publish_by_merger"].items():
        p90 = "-" if dist["p90"] is None else f"{dist['p90']:.3f}s"
        print(f"  decision->published, merged by {kind}: {dist['count']} rounds, median "
              f"{dist['median']:.3f}s, p90 {p90}")
    print(f"tokens {d['tokens']:,} for a budget of {d['token_budget']:,}: overshoot "
          f"{d['budget_overshoot']:+.2%}")
    print(f"Dagster: runs {d['dagster_runs']}; database {d['dagster_database_bytes'] / 1e6:.1f} "
          f"MB ({d['dagster_database_bytes_per_round'] / 1e3:.1f} KB a merged round)")
    if reference is None:
        return
    print(f"reference simulator: {reference['wall_seconds']:.0f}s wall, "
          f"{reference['tokens_per_second']:.0f} tok/s, loss {reference['final_heldout_loss']:.3f}")
    if result["steady_throughput_ratio_demo_to_reference"] is not None:
        print(f"demo steady state (10% -> 90% of the budget): "
              f"{d['steady_tokens_per_second']:.0f} tok/s = "
              f"{result['steady_throughput_ratio_demo_to_reference']:.2f} of the reference; "
              f"first token {d['seconds_to_first_token']:.0f}s after the command started")
    print(f"reference simulator, clock calibrated to the demo ({calibration}): loss "
          f"{calibrated['final_heldout_loss']:.3f}, demo / calibrated "
          f"{result['final_loss_ratio_demo_to_calibrated_reference']:.3f}")
    print(f"throughput demo / reference: {result['throughput_ratio_demo_to_reference']:.2f}; "
          f"final loss demo / reference: {result['final_loss_ratio_demo_to_reference']:.3f}")
    t, tc = result["test_vs_reference"], result["test_vs_calibrated_reference"]
    print(f"test slice ({d['test_slice']['batches']} batches): demo {d['test_slice']['loss']:.4f}"
          f"; demo / reference {t['ratio']:.4f} +- {t['ratio_standard_error']:.4f}, demo / "
          f"calibrated {tc['ratio']:.4f} +- {tc['ratio_standard_error']:.4f} (paired by batch)")


if __name__ == "__main__":
    main()
