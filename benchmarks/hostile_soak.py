"""Hostile-learner soak: a run on the real Dagster path in which one learner, besides training,
writes malformed and adversarial records for the whole run, against the same run without it.

Same setup as `benchmarks/chaos_soak.py` (4 learners, Decoupled DiLoCo K=2 of M=4, P=2, the
syncer service, the Dagster daemon and sensors). The tape gives learner-3 the fault
`hostile_records` from 10% of its steps to the end: every few steps it writes the next kind of
`resources.chaos.hostile_records.KINDS` within its own write rules (its heartbeat, well-formed ones
claiming 2^62 tokens or 1e300 seconds a step, a forged attempt record, offers to the open round:
manifests that lie, npy and zip bombs, pickles, payloads of the wrong dtype, a trillion claimed
steps on a huge delta, replays, a copy of a peer's offer, fields only observers read) while it
keeps training and offering honestly.

Figures: records written by kind; what became of every planted contribution whose round came
(refused by the merge with its reason, late, or not admitted); rounds merged and whether any
merge took a hostile offer; the token ledger (balanced, and the attempt records it refused);
sensor ticks by status (a failed tick is a record that reached Dagster unrefused); uptime and
loss against the run without the hostile learner.

The loss is the final global model's on the held-out test slice (100 batches spread over the
whole held-out stream, scored as the quality benchmarks score, `benchmarks/quality/
store_scoring.py`), with the paired difference of each hostile run's batch losses against its
pair's fault-free run and its standard error, so a reader can tell a difference from noise. The
syncer's own final eval (the first `eval_batches` held-out batches, 512 tokens, several percent
of sampling noise) is kept beside it as `small_eval`.

Three pairs of runs by default (`--repeats`): figures are medians and ranges, and the verdict
checks the bar: every planted contribution refused, no sensor tick failed, each hostile run's
test-slice loss within 2% of the fault-free runs' median and its tokens not cut short.

    python benchmarks/hostile_soak.py            # ~30 min on 2 cores
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
DEFAULT_OUT = REPO / "benchmarks" / "results" / "hostile_soak.json"
HOSTILE = "learner-3"


def hostile_tape(budget: int, every_steps: int) -> dict:
    from chaos_soak import LEARNERS, TOKENS_PER_STEP

    steps = budget // (LEARNERS * TOKENS_PER_STEP)
    return {"seed": 0, "faults": [{"id": "hostile", "kind": "hostile_records",
                                   "learner": HOSTILE, "at_step": steps // 10,
                                   "params": {"every_steps": every_steps}}]}


def planted_outcomes(store, planted: list[dict]) -> list[dict]:
    """What became of each planted contribution whose round was decided."""
    from diloco_core.stored_merge import StoredMerge

    out = []
    for t in planted:
        decision = store.get_decision(t["round"])
        if decision is None:
            out.append({**t, "outcome": "round never came"})
            continue
        fragment = decision.fragment
        current = store.current_version(fragment)
        found = store.find_round_commit(fragment, t["round"], current,
                                        store.version_meta(fragment, current) or StoredMerge())
        meta = found[1] if found else (store.get_round_not_merged(t["round"]) or StoredMerge())
        rejected = meta.rejected.get(HOSTILE)
        if HOSTILE in meta.members:
            outcome = "MERGED"
        elif rejected:
            outcome = f"refused by the merge: {rejected}"
        elif HOSTILE in decision.late:
            outcome = "late (not merged)"
        elif HOSTILE not in decision.members:
            outcome = "not admitted by the quorum"
        else:
            outcome = "admitted, not merged, no reason recorded"
        out.append({**t, "outcome": outcome})
    return out


def sensor_ticks(dagster_home: Path) -> dict[str, dict[str, int]]:
    """Ticks of each sensor by status, from the run's Dagster instance."""
    import dagster as dg

    counts: dict[str, dict[str, int]] = {}
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        for state in instance.all_instigator_state():
            ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id,
                                       limit=1_000_000)
            row = counts.setdefault(state.instigator_name, {})
            for tick in ticks:
                row[tick.status.value] = row.get(tick.status.value, 0) + 1
    return counts


def one_pair(cfg, tape_path: Path, tmp: Path, repeat: int) -> dict:
    """A fault-free run and a hostile run of the same config: their figures."""
    from chaos_soak import figures, soak_run

    from resources.chaos.hostile_records import read_log
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store

    runs, extra = {}, {}
    for name in ("fault_free", "hostile"):
        print(f"hostile soak, repeat {repeat}: {name}", flush=True)
        started = time.time()
        workdir = tmp / f"{name}-{repeat}"
        s = soak_run(cfg, tape_path if name == "hostile" else None, workdir)
        runs[name] = {**s, "started": started}
        store = ArtifactStore(open_blob_store(str(workdir / "demo" / "store")), cfg.name)
        log = read_log(store, HOSTILE) or {}
        stop = store.stop_requested() or {}
        extra[name] = {
            "sensor_ticks": sensor_ticks(workdir / "demo" / "dagster_home"),
            "written": log.get("written", {}), "skipped": log.get("skipped", 0),
            "planted": planted_outcomes(store, log.get("planted", [])),
            "refused_records": s["ledger"].get("refused_records", []),
            # Every processed token in exactly one fate, and what did not reconcile (a
            # stored offer whose claim is not the learner's, e.g. a forged copy).
            "tokens_add_up": abs(sum(s["ledger"]["tokens"].values())
                                 - s["ledger"]["tokens_processed"]) < 1e-6,
            "ledger_problems": s["ledger"].get("problems", []),
            # Why the run stopped, and at how many tokens by the learners' own ledgers (a
            # heartbeat claiming 2^62 tokens must not end it early).
            "stop_reason": stop.get("reason"),
            "tokens_processed": s["ledger"]["tokens_processed"],
        }
    return {name: {**figures(s, None if name == "fault_free" else runs["fault_free"],
                             cfg.sync.min_quorum), **extra[name]}
            for name, s in runs.items()}


def loss_ratios(free: list[float], hostile: list[float]) -> dict:
    """Each hostile run's loss over the fault-free runs' median: median and range, and the
    fault-free runs' own spread around their median (the run-to-run noise)."""
    median = statistics.median(free)
    ratios = [x / median for x in hostile]
    return {"fault_free_loss_median": median, "fault_free_loss": free, "hostile_loss": hostile,
            "hostile_loss_ratio_median": statistics.median(ratios),
            "hostile_loss_ratio_range": [min(ratios), max(ratios)],
            "fault_free_ratio_range": [min(free) / median, max(free) / median]}


def verdict(pairs: list[dict]) -> dict:
    """The issue's bar over the repeats: every planted contribution refused, no sensor tick
    failed, no round lost, the run not stopped early, each hostile run's test-slice loss within
    2% of the fault-free runs' median."""
    test = loss_ratios([p["fault_free"]["test_slice"]["loss"] for p in pairs],
                       [p["hostile"]["test_slice"]["loss"] for p in pairs])
    first = pairs[0]["fault_free"]["test_slice"]
    test["test_slice"] = (f"{first['batches']} batches of {first['batch_size']} x "
                          f"{first['seq_len']} tokens spread over the held-out stream "
                          "(diloco_core/eval_slices.py)")
    test["fault_free_loss_standard_error"] = [p["fault_free"]["test_slice"]["standard_error"]
                                              for p in pairs]
    test["hostile_loss_standard_error"] = [p["hostile"]["test_slice"]["standard_error"]
                                           for p in pairs]
    # Hostile minus fault-free, pair by pair, on the same batches: the noise of the comparison.
    test["paired_hostile_minus_fault_free"] = [p["hostile"]["test_paired_vs_fault_free"]
                                               for p in pairs]
    small = loss_ratios([p["fault_free"]["final_eval_loss"] for p in pairs],
                        [p["hostile"]["final_eval_loss"] for p in pairs])
    ratios = test["hostile_loss_ratio_range"]
    merged = [o for p in pairs for o in p["hostile"]["planted"] if o["outcome"] == "MERGED"]
    failed_ticks = sum(row.get("FAILURE", 0) for p in pairs
                       for row in p["hostile"]["sensor_ticks"].values())
    lost = [p["hostile"]["rounds_opened"] - p["hostile"]["rounds_merged"] for p in pairs]
    early = [p["hostile"]["tokens_processed"] / p["fault_free"]["tokens_processed"]
             for p in pairs]
    return {
        "loss_on": "the held-out test slice",
        **test,
        # The syncer's own final eval: the first eval_batches held-out batches (512 tokens).
        "small_eval": small,
        "planted_merged": merged,
        "planted_total": sum(len(p["hostile"]["planted"]) for p in pairs),
        "failed_sensor_ticks": failed_ticks,
        "rounds_not_merged": lost,
        "tokens_vs_fault_free": early,
        "met": (not merged and failed_ticks == 0
                and all(abs(r - 1) <= 0.02 for r in ratios)
                and all(e >= 0.95 for e in early)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=600_000, help="tokens per run")
    parser.add_argument("--every-steps", type=int, default=4,
                        help="the hostile learner writes one record every this many steps")
    parser.add_argument("--repeats", type=int, default=3,
                        help="pairs of runs (fault-free, hostile); figures are their medians")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    os.environ.setdefault("DILOCO_TICK_SECONDS", "2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from chaos_soak import configs

    from pipelines.reporting import code_revision, machine_info
    from resources.chaos.hostile_records import KINDS

    revision = code_revision()
    cfg = configs(args.budget)["decoupled"]
    tape = hostile_tape(args.budget, args.every_steps)
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        tape_path = Path(tmp) / "tape.json"
        tape_path.write_text(json.dumps(tape))
        pairs = [one_pair(cfg, tape_path, Path(tmp), i) for i in range(args.repeats)]
    result = {
        "benchmark": "hostile_soak",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        **revision,
        "machine": machine_info(),
        "command": "python benchmarks/hostile_soak.py " + " ".join(sys.argv[1:]),
        "config": {"token_budget": args.budget, "hostile_learner": HOSTILE,
                   "every_steps": args.every_steps, "repeats": args.repeats,
                   "kinds": list(KINDS)},
        "tape": tape,
        "verdict": verdict(pairs),
        "repeats": pairs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for i, pair in enumerate(pairs):
        h = pair["hostile"]
        outcomes: dict[str, int] = {}
        for p in h["planted"]:
            key = p["outcome"].split(":")[0]
            outcomes[key] = outcomes.get(key, 0) + 1
        print(f"repeat {i}: records written by kind: {h['written']}")
        print(f"repeat {i}: planted contributions: {outcomes}")
        print(f"repeat {i}: attempt records refused by the ledger: "
              f"{len(h['refused_records'])}; tokens add up: {h['tokens_add_up']}; ledger "
              f"problems: {h['ledger_problems']}; stopped: {h['stop_reason']}")
        print(f"repeat {i}: sensor ticks: {h['sensor_ticks']}")
        for name, r in pair.items():
            t = r["test_slice"]
            print(f"repeat {i}: {name:10} merges {r['rounds_merged']}/{r['rounds_opened']}, "
                  f"uptime {r['uptime']:.3f}, test-slice loss {t['loss']:.4f} +- "
                  f"{t['standard_error']:.4f} (small eval {r['final_eval_loss']:.3f}), wall "
                  f"{r['wall_seconds']:.0f}s, ledger "
                  f"{'balanced' if r['ledger_balanced'] else 'UNBALANCED'}")
        d = h["test_paired_vs_fault_free"]
        print(f"repeat {i}: hostile - fault-free, paired on the test slice: {d['mean']:+.4f} +- "
              f"{d['standard_error']:.4f} nats (ratio {d['ratio']:.4f} +- "
              f"{d['ratio_standard_error']:.4f})")
    v = result["verdict"]
    print(f"hostile / fault-free test-slice loss: median {v['hostile_loss_ratio_median']:.4f}, "
          f"range {v['hostile_loss_ratio_range'][0]:.4f}-{v['hostile_loss_ratio_range'][1]:.4f} "
          f"(fault-free runs {v['fault_free_ratio_range'][0]:.4f}-"
          f"{v['fault_free_ratio_range'][1]:.4f}; small eval: median "
          f"{v['small_eval']['hostile_loss_ratio_median']:.4f}); planted merged: "
          f"{len(v['planted_merged'])} of {v['planted_total']}; failed "
          f"sensor ticks: {v['failed_sensor_ticks']}; tokens vs fault-free: "
          f"{[round(x, 3) for x in v['tokens_vs_fault_free']]}; met: {v['met']}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
