"""Chaos soak: a seeded random kill/restart loop on the real Dagster path, Decoupled DiLoCo
against synchronous DiLoCo on the same tape.

Runs of `diloco demo` (Dagster daemon, sensors, one process per learner, the syncer service),
one after the other on this machine, same model, data, learners and token budget:

  decoupled            K=2 of M=4, P=2 fragments, adaptive grace window, rebase on receipt;
                       no faults
  decoupled + tape     the same, under the fault tape
  synchronous          K=M, P=1, no overlap, no grace, every learner blocks at each sync
                       until the merge arrives (sync.block_on_overlap); no faults
  synchronous + tape   the same, under the same tape

and, for each `--extra-seeds` seed, both methods under that seed's tape ("<method>/tape-s<seed>"):
where a kill lands in a learner's interval moves the final loss by percents, so the comparison
at equal tokens is the mean over the tapes (`comparison` in the result).

The tape (`kill_loop_tape`, seeded) SIGKILLs learner processes at given steps (the learner
supervisor relaunches them from their last checkpoint), SIGKILLs the syncer service at given
rounds (the quorum sensor decides and merges until the supervisor's relaunched syncer holds
the lease again) and restarts the Dagster daemon and webserver at given seconds. The same
steps and rounds fire in both methods.

Figures per run: faults fired; rounds merged; uptime (share of time the global model kept
advancing, stalls measured against the fault-free run's median gap between merges); K-up
uptime (share of time at least K learner processes were up: the goodput simulator's uptime;
for synchronous DiLoCo K = M, so any dead learner stops it); goodput
(tokens merged / what the allocated learners could have processed, from the token ledger);
rejoin time (kill -> first merge that includes the relaunched learner) median and max; the
final global model's loss on the held-out test slice (`test_slice`: 100 batches spread over the
whole held-out stream, as the quality benchmarks score, `benchmarks/quality/store_scoring.py`)
against the fault-free run, with the paired difference of their batch losses and its standard
error; the syncer's own final eval (`final_eval_loss`, the first `eval_batches` held-out batches,
512 tokens: several percent of sampling noise, kept for continuity); wall time to the token
budget; the ledger.

    python benchmarks/chaos_soak.py                 # two tapes, six runs: ~30 min on 2 cores
    python benchmarks/chaos_soak.py --budget 300000 --kills 4   # a shorter soak
"""

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEFAULT_OUT = REPO / "benchmarks" / "results" / "chaos_soak.json"
PLOT = REPO / "docs" / "img" / "chaos_soak.png"
# Ledger fates caused by a fault (the rest are the algorithm's own: superseded on receipt,
# late, a round that merged nothing).
FAILURE_FATES = ("died_before_offer", "offer_not_stored", "duplicate_offer", "rejected")

LEARNERS = 4
TOKENS_PER_STEP = 4 * 32  # data.batch_size x data.seq_len below
SOAK = ["name=soak", "model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
        f"learners.num_learners={LEARNERS}", "learners.speeds=[1.0, 1.0, 1.0, 1.0]",
        "orchestration.step_seconds_floor=0.1", "sync.sync_period=120",
        "sync.num_fragments=2", "sync.min_quorum=2", "sync.grace_min_seconds=1",
        "orchestration.eval_batches=4", "orchestration.checkpoint_every_steps=20",
        "orchestration.heartbeat_seconds=1", "orchestration.learner_timeout_seconds=15",
        "orchestration.restart_backoff_seconds=5", "orchestration.round_timeout_seconds=90",
        # As the orchestrated defaults (pipelines/launch_defaults.py): a late merge keeps the
        # learner's progress since its offer. The soak at abcf6ad ran overwrite on receipt.
        "sync.receive_rule=rebase"]


def configs(budget: int, overrides: list[str] = ()):
    from diloco_core.baselines import synchronous_config
    from pipelines.commands.cli import load_config

    decoupled = load_config(None, SOAK + [f"token_budget={budget}", *overrides])
    return {"decoupled": decoupled, "synchronous": synchronous_config(decoupled)}


def make_tape(seed: int, budget: int, kills: int, restarts: list[tuple[str, float]],
              syncer_kills: int = 0) -> dict:
    from diloco_core.fault_tape import kill_loop_tape

    steps = budget // (LEARNERS * TOKENS_PER_STEP)
    # Rounds both methods reach: synchronous DiLoCo (P = 1) has one every H steps.
    sync_rounds = steps // configs(budget)["synchronous"].sync.sync_period
    # Kills between 10% and 85% of each learner's steps: after the first merges, and early
    # enough that the relaunched learner has rounds left to rejoin in.
    tape = kill_loop_tape(seed, [f"learner-{i}" for i in range(LEARNERS)],
                          steps=int(0.85 * steps), kills=kills,
                          min_gap_steps=max(1, steps // 5), first_step=steps // 10,
                          restarts=restarts)
    mapping = tape.to_mapping()
    mapping["faults"] += [{"id": f"syncer-kill-{r}", "kind": "syncer_kill", "at_round": r}
                          for r in sorted({max(1, (i + 1) * sync_rounds // (syncer_kills + 1))
                                           for i in range(syncer_kills)})]
    return mapping


def soak_run(cfg, tape_path: Path | None, workdir: Path, keep: Path | None = None) -> dict:
    from benchmarks.quality.store_scoring import score_store
    from pipelines.commands.demo import run_demo
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store

    # Every run starts with an empty compilation cache, as on a fresh machine: its relaunched
    # processes reuse what it compiled, and no run (or arm) inherits another's programs.
    cfg = cfg.replace(orchestration=dataclasses.replace(
        cfg.orchestration, compilation_cache_dir=str(workdir / "jax-cache")))
    out = workdir / "summary.json"
    code = run_demo(cfg, chaos=False, json_path=str(out), workdir=str(workdir / "demo"),
                    port=None, timeout=3600,
                    fault_tape_path=str(tape_path) if tape_path else None)
    if code != 0:
        raise SystemExit(f"the soak run in {workdir} failed")
    summary = json.loads(out.read_text())
    store = ArtifactStore(open_blob_store(str(workdir / "demo" / "store")), cfg.name)
    evals = []  # (when the round's merge was published, held-out loss after it)
    for r in summary["rounds"]:
        e = store.get_eval(r["round"]) if r["merged"] else None
        if e:
            evals.append((r["published_at"], e.loss))
    summary["eval_curve"] = sorted(evals)
    # A round decided only when the round timeout ran out held the run up for that long (the
    # round open at STOP waits for every live learner that neither offered nor declined).
    summary["timed_out_rounds"] = [
        {"round": d.round, "waited": round(d.decided_at - d.opened_at, 1),
         "missing": list(d.missing), "reason": d.reason[:200]}
        for r in summary["rounds"]
        if (d := store.get_decision(r["round"])) is not None and "timed out" in d.reason]
    if keep is not None and summary["timed_out_rounds"]:
        # The evidence to find out why, before the temporary directory goes: its store (the
        # learners' heartbeats and attempt records, the decisions) and the Dagster run logs.
        target = keep / workdir.name
        shutil.copytree(workdir / "demo", target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("jax-cache", "checkpoints"))
        print(f"soak: a round timed out; kept the run in {target}", flush=True)
    # Scored while the run's store exists (the soaks run in a temporary directory).
    summary["test_slice"] = score_store(store)
    return summary


def quorum_uptime(s: dict, quorum: int, learners: int, span: tuple[float, float]) -> float:
    """Share of `span` in which at least `quorum` learner processes were up (the goodput
    simulator's uptime): a learner is down from a kill until its relaunched process started."""
    down = [(r["at"], r["relaunched_at"] or span[1]) for r in s["rejoins"]]
    edges = sorted({span[0], span[1], *[min(max(t, span[0]), span[1]) for iv in down
                                        for t in iv]})
    up_time = 0.0
    for a, b in zip(edges, edges[1:], strict=False):
        mid = (a + b) / 2
        if learners - sum(lo <= mid < hi for lo, hi in down) >= quorum:
            up_time += b - a
    return up_time / (span[1] - span[0]) if span[1] > span[0] else 1.0


def figures(s: dict, reference: dict | None, quorum: int) -> dict:
    from benchmarks.quality.store_scoring import paired_difference
    from pipelines.run_summary import uptime

    publish = sorted(r["published_at"] for r in s["rounds"] if r["merged"])
    ref_publish = sorted(r["published_at"] for r in (reference or s)["rounds"] if r["merged"])
    ref_gap = statistics.median(b - a for a, b in zip(ref_publish, ref_publish[1:],
                                                       strict=False))
    rejoin = [r["rejoin_seconds"] for r in s["rejoins"] if r["rejoin_seconds"] is not None]
    ledger = s["ledger"]
    learners = len(s["learner_attempts"])
    start = s["started"]
    out = {
        "quorum_uptime": quorum_uptime(s, quorum, learners, (publish[0], publish[-1])),
        "quorum": quorum,
        "faults_fired": s.get("faults_fired", {}),
        "rounds_merged": s["rounds_merged"], "rounds_opened": s["rounds_opened"],
        "uptime": uptime(publish, median_gap=ref_gap),
        "uptime_own_median": s["uptime"],
        "goodput": s["goodput"],
        "rejoins": len(s["rejoins"]),
        "rejoins_never_back": sum(r["rejoin_seconds"] is None for r in s["rejoins"]),
        "rejoin_seconds_median": statistics.median(rejoin) if rejoin else None,
        "rejoin_seconds_max": max(rejoin) if rejoin else None,
        "rounds_missed_max": max((r["rounds_missed"] or 0 for r in s["rejoins"]), default=0),
        "utilisation": (ledger["tokens_processed"] / s["learner_capacity_tokens"]
                        if s.get("learner_capacity_tokens") else None),
        "failure_loss": (sum(ledger["tokens"][k] for k in FAILURE_FATES)
                         / s["learner_capacity_tokens"]
                         if s.get("learner_capacity_tokens") else None),
        # Kill -> the relaunched process started (supervisor backoff, run launch, imports):
        # the repair time of the goodput simulator's cross-check.
        "relaunch_seconds": [r["relaunched_at"] - r["at"] for r in s["rejoins"]
                             if r["relaunched_at"] is not None],
        "learners": learners,
        # The timeline, in seconds after the train job was launched.
        "outages": [{"learner": r["learner"], "kind": r["kind"], "at": r["at"] - start,
                     "relaunched": (r["relaunched_at"] or start) - start,
                     "back_in_round": r["back_in_round"],
                     "merged_again": (None if r["rejoin_seconds"] is None
                                      else r["at"] + r["rejoin_seconds"] - start)}
                    for r in s["rejoins"]],
        "merges_published": [t - start for t in publish],
        "eval_curve": [(t - start, v) for t, v in s["eval_curve"]],
        "initial_eval_loss": s["initial_eval_loss"],
        # The syncer's own eval: the first eval_batches held-out batches (small, noisy).
        "final_eval_loss": s["final_eval_loss"],
        # The figure to compare runs on: the held-out test slice, with each batch's loss.
        "test_slice": s["test_slice"],
        "wall_seconds": s["wall_seconds"], "tokens": s["tokens"],
        "learner_idle_fraction": s["learner_idle_fraction"],
        "merge_latency_median_seconds": s["merge_latency_seconds"]["median"],
        "ledger_balanced": ledger["balanced"], "ledger_exact": ledger["exact"],
        "ledger_tokens": ledger["tokens"], "tokens_processed": ledger["tokens_processed"],
        # What the learners trained that reached no merged version, for any reason (the
        # ledger's fates other than merged): under rebase nothing is superseded on receipt by
        # construction, so this, not that, is the figure of merit.
        "never_merged_fraction": (1 - ledger["tokens"].get("merged", 0)
                                  / ledger["tokens_processed"]
                                  if ledger["tokens_processed"] else None),
        "restarts": [{k: r[k] for k in ("kind", "seconds", "reaped_runs")}
                     for r in s.get("restarts", [])],
        "timed_out_rounds": s.get("timed_out_rounds", []),
    }
    if reference is not None:
        out["final_eval_loss_vs_fault_free"] = (s["final_eval_loss"]
                                                / reference["final_eval_loss"])
        out["test_loss_vs_fault_free"] = (s["test_slice"]["loss"]
                                          / reference["test_slice"]["loss"])
        # This run minus the fault-free one, batch by batch on the same test batches.
        out["test_paired_vs_fault_free"] = paired_difference(
            s["test_slice"]["batch_losses"], reference["test_slice"]["batch_losses"])
        out["wall_seconds_vs_fault_free"] = s["wall_seconds"] / reference["wall_seconds"]
    return out


def plot(result: dict, path: Path) -> None:
    """Held-out loss and global-model progress over wall time, from the results JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"decoupled": "tab:blue", "synchronous": "tab:red"}
    for name, r in result["runs"].items():
        method, faulty = name.split("/")
        style = {"linestyle": ("-" if faulty == "tape" else "--" if faulty.startswith("tape")
                               else ":"), "color": colors[method]}
        label = f"{method}, {faulty.replace('_', '-')}"
        curve = r["eval_curve"]
        axes[0].plot([t for t, _ in curve], [v for _, v in curve], label=label, **style)
        # A merge updates one fragment: P merges make one full-model sync.
        P = result["fragments"][method]
        publish = r["merges_published"]
        axes[1].step(publish, [(i + 1) / P for i in range(len(publish))], where="post",
                     label=label, **style)
        for outage in r["outages"] if faulty == "tape" else []:   # the first tape's only
            axes[1].axvspan(outage["at"], outage["relaunched"], color=colors[method],
                            alpha=0.08, lw=0)
    axes[0].set(xlabel="wall seconds after launch", ylabel="held-out loss",
                title="Held-out loss after each merge")
    axes[1].set(xlabel="wall seconds after launch", ylabel="full-model syncs (merges / P)",
                title="Global model progress (shaded: a learner down)")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=600_000, help="tokens per run")
    parser.add_argument("--kills", type=int, default=8, help="learner SIGKILLs on the tape")
    parser.add_argument("--syncer-kills", type=int, default=2,
                        help="SIGKILLs of the syncer service on the tape")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--extra-seeds", type=int, nargs="*", default=[8],
                        help="more tapes (seeded like --seed) replayed against both methods: "
                             "where a kill falls in a learner's interval moves the loss by "
                             "percents, so one tape per method does not settle the comparison")
    parser.add_argument("--daemon-restart-at", type=float, default=120.0)
    parser.add_argument("--webserver-restart-at", type=float, default=200.0)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="FIELD=VALUE",
                        help="an override on top of the soak's config, for every method "
                             "(e.g. sync.receive_rule=rebase)")
    parser.add_argument("--methods", nargs="+", choices=("decoupled", "synchronous"),
                        default=["decoupled", "synchronous"])
    parser.add_argument("--keep", type=Path, default=None,
                        help="copy a run whose round waited out the round timeout here "
                             "(its store and Dagster home), to look into it later")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--plot", default=str(PLOT))
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the plot and table from --out, run nothing")
    args = parser.parse_args()
    if args.plot_only:
        result = json.loads(Path(args.out).read_text())
        if "fragments" not in result:  # results written before the field existed
            result["fragments"] = {m: c.sync.num_fragments for m, c in
                                   configs(result["config"]["token_budget"]).items()}
            Path(args.out).write_text(json.dumps(result, indent=2))
        plot(result, Path(args.plot))
        print_table(result["runs"])
        return
    os.environ.setdefault("DILOCO_TICK_SECONDS", "2")
    # Stopped with SIGTERM (or SIGINT, which background jobs ignore): unwind, so that the
    # Dagster instance of the current run (its own process groups) is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from pipelines.reporting import code_revision, machine_info

    revision = code_revision()     # at the start: the code the runs execute
    restarts = [("daemon_restart", args.daemon_restart_at),
                ("webserver_restart", args.webserver_restart_at)]
    tape = make_tape(args.seed, args.budget, args.kills, restarts, args.syncer_kills)
    # The first tape's runs keep the names "<method>/tape"; each extra seed adds "tape-s<seed>".
    tapes = {"tape": tape, **{f"tape-s{seed}": make_tape(seed, args.budget, args.kills,
                                                         restarts, args.syncer_kills)
                              for seed in args.extra_seeds if seed != args.seed}}
    cfgs = {m: c for m, c in configs(args.budget, args.overrides).items() if m in args.methods}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        paths = {}
        for label, mapping in tapes.items():
            paths[label] = Path(tmp) / f"{label}.json"
            paths[label].write_text(json.dumps(mapping))
        for method, cfg in cfgs.items():
            for faulty in ("fault_free", *tapes):
                name = f"{method}/{faulty}"
                print(f"soak: {name}", flush=True)
                started = time.time()
                s = soak_run(cfg, paths.get(faulty), Path(tmp) / name.replace("/", "-"),
                             args.keep)
                runs[name] = {**s, "started": started}
    result = {
        "benchmark": "chaos_soak",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": revision,
        "machine": machine_info(),
        "command": "python benchmarks/chaos_soak.py " + " ".join(sys.argv[1:]),
        "config": {"overrides": SOAK + args.overrides, "token_budget": args.budget,
                   "synchronous": "synchronous_config(decoupled) (sync.block_on_overlap=true, "
                                  "tau=0)"},
        "tape": tape,
        "extra_tapes": {label: t for label, t in tapes.items() if label != "tape"},
        "fragments": {method: cfg.sync.num_fragments for method, cfg in cfgs.items()},
        "runs": {name: figures(s, None if name.endswith("fault_free")
                               else runs[f"{name.split('/')[0]}/fault_free"],
                               cfgs[name.split("/")[0]].sync.min_quorum)
                 for name, s in runs.items()},
    }
    result["comparison"] = compare(result["runs"], list(tapes))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    plot(result, Path(args.plot))
    print_table(result["runs"])
    mean = result["comparison"].get("mean")
    if mean:
        print(f"decoupled / synchronous over {result['comparison']['tapes']} tapes: test-slice "
              f"loss {mean['test_loss_ratio']:.3f} (small eval {mean['loss_ratio']:.3f}), wall "
              f"time {mean['wall_ratio']:.3f}; uptime {mean['uptime_decoupled']:.3f} vs "
              f"{mean['uptime_synchronous']:.3f}")
        for label, t in result["comparison"]["per_tape"].items():
            d = t["test_paired"]
            print(f"  {label}: decoupled - synchronous on the test slice "
                  f"{d['mean']:+.4f} +- {d['standard_error']:.4f} nats "
                  f"(ratio {d['ratio']:.4f} +- {d['ratio_standard_error']:.4f})")
    print(f"written to {args.out} and {args.plot}")


def compare(runs: dict, tapes: list[str]) -> dict:
    """Decoupled against synchronous DiLoCo under the same tapes: the final loss at equal
    tokens on the held-out test slice (`test_*`, with the paired difference of the two runs'
    batch losses) and on the syncer's small eval (`loss_*`), and the wall time to the budget,
    per tape and as means over the tapes."""
    from benchmarks.quality.store_scoring import paired_difference

    per_tape = {}
    for label in tapes:
        d, s = runs.get(f"decoupled/{label}"), runs.get(f"synchronous/{label}")
        if d and s:
            per_tape[label] = {
                "loss_decoupled": d["final_eval_loss"], "loss_synchronous": s["final_eval_loss"],
                "loss_ratio": d["final_eval_loss"] / s["final_eval_loss"],
                "wall_ratio": d["wall_seconds"] / s["wall_seconds"],
                "uptime_decoupled": d["uptime"], "uptime_synchronous": s["uptime"]}
            if "test_slice" in d and "test_slice" in s:   # results before the test slice: none
                dt, st = d["test_slice"], s["test_slice"]
                per_tape[label].update({
                    "test_loss_decoupled": dt["loss"], "test_loss_synchronous": st["loss"],
                    "test_loss_ratio": dt["loss"] / st["loss"],
                    "test_paired": paired_difference(dt["batch_losses"], st["batch_losses"])})
    if not per_tape:
        return {}
    first = next(iter(per_tape.values()))
    mean = {k: statistics.fmean(t[k] for t in per_tape.values())
            for k, v in first.items() if isinstance(v, float | int)}
    return {"per_tape": per_tape, "mean": mean, "tapes": len(per_tape)}


def print_table(runs: dict) -> None:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"{'run':24} {'faults':>6} {'merges':>6} {'uptime':>6} {'K-up':>6} {'goodput':>7} "
          f"{'rejoin med/max s':>16} {'test':>6} {'vs free':>7} {'small':>6} {'wall s':>6}"
          "  ledger")
    for name, r in runs.items():
        print(f"{name:24} {sum(r['faults_fired'].values()):>6} {r['rounds_merged']:>6} "
              f"{r['uptime']:>6.3f} {r['quorum_uptime']:>6.3f} {fmt(r['goodput'], '.3f'):>7} "
              f"{fmt(r['rejoin_seconds_median'], '.0f'):>7}/"
              f"{fmt(r['rejoin_seconds_max'], '.0f'):<8}"
              f" {fmt(r.get('test_slice', {}).get('loss'), '.3f'):>6} "
              f"{fmt(r.get('test_loss_vs_fault_free'), '.3f'):>7} "
              f"{r['final_eval_loss']:>6.3f} {r['wall_seconds']:>6.0f}  "
              f"{'balanced' if r['ledger_balanced'] else 'UNBALANCED'}")


if __name__ == "__main__":
    main()
