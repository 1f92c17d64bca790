"""Experiment 1 confirmed through the real Dagster path: the same runs, orchestrated.

Each arm runs twice on the same config: once as `diloco demo` does it (Dagster daemon and
sensors, one process per learner dispatched through Pipes, one merge run per round, the artifact
store on disk) and once in the in-process reference simulator. Data-parallel is not an
orchestrated method; its reference is experiment 1's simulator run at the same budget.

The config is experiment 1's (small preset, 4 equal learners, 1M tokens, K = 1 with the grace
window, bf16, RDA), except for the sync period: H = 32 (rounds every H/P = 8 steps, about 5 s on
2 cores) instead of 16. It was chosen when every orchestrated round cost a Dagster run (10-15 s
from quorum to publication); the syncer service now publishes within a second of the decision,
and H = 32 is kept so that the figures stay comparable with the earlier runs of this benchmark.

Arms: Decoupled DiLoCo (the paper's overwrite-on-receipt) and synchronous DiLoCo (K = M, P = 1,
every learner blocks at each sync); `--rebase` adds Decoupled DiLoCo with the rebase receive rule.
Experiment 9's real-path counterpart is the chaos soak (`benchmarks/chaos_soak.py`).

    python benchmarks/quality_real_path.py        # about 17 min on 2 cores
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "benchmarks" / "results" / "quality" / "real_path.json"

from benchmarks.quality.experiments import (  # noqa: E402
    DATA_PARALLEL,
    DECOUPLED,
    HEADLINE_TOKENS,
    SYNCHRONOUS,
    Arm,
)

REAL = ("name=quality-real", "sync.sync_period=32", "sync.overlap_steps=4",
        "sync.grace_min_seconds=3", "orchestration.checkpoint_every_steps=40",
        "orchestration.heartbeat_seconds=2", "orchestration.learner_timeout_seconds=30",
        "orchestration.restart_backoff_seconds=3")
ARMS = (Arm("Decoupled DiLoCo", DECOUPLED, REAL, tokens=HEADLINE_TOKENS),
        Arm("synchronous DiLoCo", SYNCHRONOUS, REAL, tokens=HEADLINE_TOKENS))
REBASE = Arm("Decoupled DiLoCo, rebase", DECOUPLED, (*REAL, "sync.receive_rule=rebase"),
             tokens=HEADLINE_TOKENS)
DATA_PARALLEL_ARM = Arm("data-parallel", DATA_PARALLEL, (), 0, HEADLINE_TOKENS)  # experiment 1


def real_config(arm: Arm):
    from benchmarks.quality.runner import arm_config
    from diloco_core.baselines import synchronous_config

    cfg = arm_config(arm)
    if arm.method == SYNCHRONOUS:
        cfg = synchronous_config(cfg)
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--rebase", action="store_true",
                        help="also run Decoupled DiLoCo with the rebase receive rule")
    args = parser.parse_args()
    arms = (*ARMS, REBASE) if args.rebase else ARMS
    os.environ.setdefault("DILOCO_TICK_SECONDS", "2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the Dagster instance
    from benchmarks.chaos_soak import figures, soak_run
    from benchmarks.quality.runner import run_arm
    from pipelines.reporting import code_revision, machine_info

    revision = code_revision()   # before the runs: the code they ran
    dp = run_arm(DATA_PARALLEL_ARM)["summary"]["final_heldout_loss"]
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="quality-real-") as tmp:
        for i, arm in enumerate(arms):
            cfg = real_config(arm)
            print(f"real path: {arm.label}", flush=True)
            started = time.time()
            summary = soak_run(cfg, None, Path(tmp) / f"arm{i}")
            real = figures({**summary, "started": started}, None, cfg.sync.min_quorum)
            print(f"simulator: {arm.label}", flush=True)
            sim = run_arm(arm)
            ledger = real["ledger_tokens"]
            processed = real["tokens_processed"]
            sim_loss = sim["summary"]["final_heldout_loss"]
            rows.append({
                "arm": arm.label,
                "real_heldout_loss": round(real["final_eval_loss"], 4),
                "simulator_heldout_loss": round(sim_loss, 4),
                "real_vs_simulator": round(real["final_eval_loss"] / sim_loss, 4),
                "real_vs_data_parallel": round(real["final_eval_loss"] / dp, 4),
                "simulator_vs_data_parallel": round(sim_loss / dp, 4),
                "real_wall_seconds": round(real["wall_seconds"]),
                "rounds_merged": real["rounds_merged"],
                "merge_latency_median_s": round(real["merge_latency_median_seconds"], 1),
                # Tokens that reached no merged version, for any reason (rebase makes the
                # superseded share zero by construction; it stays as a detail).
                "never_merged": round(1 - ledger.get("merged", 0) / processed, 3)
                if processed else None,
                "superseded_on_receipt": round(ledger.get("superseded_on_receipt", 0)
                                               / processed, 3) if processed else None,
                "ledger": "balanced, exact" if real["ledger_balanced"] and real["ledger_exact"]
                else "balanced" if real["ledger_balanced"] else "UNBALANCED",
            })
            runs[arm.label] = {"real": real, "simulator_run": sim["key"]}
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "quality_real_path",
              "when": datetime.now(UTC).isoformat(timespec="seconds"),
              "commit": revision, "machine": machine_info(),
              "command": "python benchmarks/quality_real_path.py"
                         + (" --rebase" if args.rebase else ""),
              "overrides": list(REAL), "token_budget": HEADLINE_TOKENS,
              "data_parallel_heldout_loss": dp, "rows": rows, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
