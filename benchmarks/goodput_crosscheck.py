"""Cross-check: the goodput simulator (`diloco_core.goodput`, no ML) against the goodput the
chaos soak measured on the real Dagster path.

The soak is the simulator's model scaled down to one machine: M = 4 learners of one "slice"
(a learner process) each, failures = the tape's SIGKILLs, repair = the time from a kill until
the relaunched process runs again. The simulator is run with

  chips = slice_chips-per-learner x M = 4, slice_chips = 1, learners = 4, min_quorum = K,
  MTBI = the soak's observed learner-seconds per kill, horizon = the soak's wall time,
  repair_seconds = measured (median kill -> relaunch; as an upper bound kill -> merged again),
  downscale/upscale = 0 (a one-slice learner has nothing to reconfigure),

and compared with the measured *failure-attributable* goodput: goodput under the tape divided
by goodput of the fault-free run of the same method (the simulator models failures only, not
the overlap losses and merge latency that both runs share). Every tape the soak ran
(`--extra-seeds`) is checked on its own, with its own kills, wall time and repair times; the
medians over tapes are what to quote (one tape's kills land where they land).

    python benchmarks/chaos_soak.py && python benchmarks/goodput_crosscheck.py
"""

import argparse
import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SOAK = REPO / "benchmarks" / "results" / "chaos_soak.json"
OUT = REPO / "benchmarks" / "results" / "goodput_crosscheck.json"
SECONDS_PER_YEAR = 365 * 24 * 3600


def simulate(learners: int, quorum: int, kills: int, wall: float, repair: float,
             seeds: int) -> dict:
    from diloco_core.goodput import GoodputParams, goodput_with_ci

    mtbi_seconds = learners * wall / kills  # per chip (= per learner here)
    params = GoodputParams(chips=learners, learners=learners, min_quorum=quorum,
                           mtbi_years=mtbi_seconds / SECONDS_PER_YEAR, slice_chips=1,
                           repair_seconds=repair, restart_seconds=repair,
                           downscale_seconds=0.0, upscale_seconds=0.0, horizon_seconds=wall)
    r = goodput_with_ci(params, seeds=seeds)
    return {k: r[k] for k in ("decoupled", "synchronous_diloco", "decoupled_uptime")}


REPAIRS = ("repair=relaunch", "repair=rejoin")


def crosscheck(name: str, tape: dict, free: dict, sim_key: str, seeds: int) -> dict:
    """One tape (the soak's run `name`) against the simulator run with that tape's failures;
    `free` is the fault-free run of the same method, the goodput the tape's is divided by."""
    kills = tape["faults_fired"].get("learner_kill", 0)
    if not kills:
        raise SystemExit(f"{name} fired no kills: nothing to cross-check")
    relaunch = statistics.median(tape["relaunch_seconds"])
    rejoin = tape["rejoin_seconds_median"] or relaunch
    learners = tape["learners"]
    sims = {name: simulate(learners, tape["quorum"], kills, tape["wall_seconds"], repair, seeds)
            for name, repair in zip(REPAIRS, (relaunch, rejoin), strict=True)}
    return {
        "kills": kills, "wall_seconds": tape["wall_seconds"],
        "mtbi_learner_seconds": learners * tape["wall_seconds"] / kills,
        "repair_seconds": {"relaunch_median": relaunch, "rejoin_median": rejoin},
        "measured_goodput": {"tape": tape["goodput"], "fault_free": free["goodput"],
                             "ratio": tape["goodput"] / free["goodput"]},
        "simulated_goodput": {name: s[sim_key] for name, s in sims.items()},
        "simulated_decoupled_uptime": {name: s["decoupled_uptime"] for name, s in sims.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak", default=str(SOAK))
    parser.add_argument("--seeds", type=int, default=400)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    from pipelines.reporting import code_revision, machine_info

    soak = json.loads(Path(args.soak).read_text())
    runs = soak["runs"]
    methods = {}
    for method, sim_key in (("decoupled", "decoupled"), ("synchronous", "synchronous_diloco")):
        free = runs[f"{method}/fault_free"]
        # "decoupled/tape" is the soak's first tape, "decoupled/tape-s8" its extra seed 8.
        tapes = {name.split("/", 1)[1]: run for name, run in runs.items()
                 if name.startswith(f"{method}/tape")}
        rows = {name: crosscheck(f"{method}/{name}", tape, free, sim_key, args.seeds)
                for name, tape in tapes.items()}
        methods[method] = {"tapes": rows, "median": {
            "measured_ratio": statistics.median(r["measured_goodput"]["ratio"]
                                                for r in rows.values()),
            **{f"simulated_{name}": statistics.median(
                r["simulated_goodput"][name]["mean"] for r in rows.values())
               for name in REPAIRS}}}
    result = {"benchmark": "goodput_crosscheck",
              "when": datetime.now(UTC).isoformat(timespec="seconds"),
              **code_revision(), "machine": machine_info(), "soak": soak["when"],
              "soak_commit": soak.get("commit"),
              # The arguments too: which soak it read is part of what produced the figures.
              "command": " ".join(["python", "benchmarks/goodput_crosscheck.py",
                                   *sys.argv[1:]]),
              "soak_file": str(Path(args.soak).resolve().relative_to(REPO))
              if Path(args.soak).resolve().is_relative_to(REPO) else args.soak,
              "seeds": args.seeds,
              "methods": methods}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'method':12} {'tape':8} {'kills':>5} {'MTBI s':>7} {'repair s':>13}  "
          f"{'measured':>8}  {'simulated (relaunch .. rejoin)':>30}")
    for method, m in methods.items():
        for tape, r in m["tapes"].items():
            sim = r["simulated_goodput"]
            print(f"{method:12} {tape:8} {r['kills']:>5} {r['mtbi_learner_seconds']:>7.0f} "
                  f"{r['repair_seconds']['relaunch_median']:>5.0f} .. "
                  f"{r['repair_seconds']['rejoin_median']:<5.0f}  "
                  f"{r['measured_goodput']['ratio']:>8.3f}  "
                  f"{sim['repair=relaunch']['mean']:>12.3f} ± "
                  f"{sim['repair=relaunch']['ci95']:.3f} .. "
                  f"{sim['repair=rejoin']['mean']:.3f} ± {sim['repair=rejoin']['ci95']:.3f}")
        med = m["median"]
        print(f"{method:12} {'median':8} {'':>5} {'':>7} {'':>13}  {med['measured_ratio']:>8.3f}  "
              f"{med['simulated_repair=relaunch']:>12.3f}   ..   "
              f"{med['simulated_repair=rejoin']:.3f}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
