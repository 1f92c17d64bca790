"""What the Dagster mirror of the syncer service costs the instance's database per round: one
partition per round (a materialization per round and offer) against partitions of several
rounds (one digest per asset and partition, `pipelines/partition_digest.py`), side by side.

Each arm: a Dagster instance on disk (SQLite, as `diloco demo`'s), a started experiment, the
syncer service's own step (in process) deciding and merging rounds that M scripted learners
offer to (the test harness's: real contributions, no training), and the quorum sensor's tick
mirroring them after every round. Measured: the database files' bytes before the first round
and after the last, and the materializations of each asset.

    python benchmarks/mirror_database.py --rounds 160 --learners 4 --per-partition 1 8
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "mirror_database.json"


def _database_bytes(home: Path) -> int:
    return sum(p.stat().st_size for p in home.rglob("*.db"))


def run_arm(rounds: int, learners: int, per_partition: int) -> dict:
    import dagster as dg

    sys.path.insert(0, str(ROOT / "tests"))
    from orchestration_harness import Harness

    names = [f"learner-{i}" for i in range(learners)]
    with tempfile.TemporaryDirectory() as tmp, dg.instance_for_test(temp_dir=tmp) as instance:
        h = Harness(instance, str(Path(tmp) / "store"), overrides=[
            "orchestration.syncer=service", f"orchestration.rounds_per_partition={per_partition}",
            f"learners.num_learners={learners}", f"sync.min_quorum={learners}",
            "token_budget=1000000000"])
        h.start()
        step, _ = h.decider("service")
        h.tick()
        before = _database_bytes(Path(tmp))
        started = time.perf_counter()
        for r in range(rounds):
            for name in names:
                h.beat(name, 2)
            step()                               # the round opens
            for name in names:
                h.offer(name, r)
            step()                               # decided and merged
            h.tick()                             # the sensor mirrors it
        step()
        h.tick()
        seconds = time.perf_counter() - started
        merged = sum(1 for r in range(rounds) if h.store.get_decision(r) is not None)
        counts = {}
        for asset in ("global_params", "learner_update", "heldout_eval"):
            counts[asset] = len(instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset)), limit=10_000).records)
        after = _database_bytes(Path(tmp))
    return {"per_partition": per_partition, "rounds": rounds, "rounds_decided": merged,
            "learners": learners, "database_bytes_before": before,
            "database_bytes_after": after,
            "database_bytes_per_round": (after - before) / rounds,
            "materializations": counts, "seconds": round(seconds, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=160)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--per-partition", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    arms = [run_arm(args.rounds, args.learners, k) for k in args.per_partition]
    for arm in arms:
        print(f"rounds per partition {arm['per_partition']:>3}: "
              f"{arm['database_bytes_per_round'] / 1e3:6.1f} KB a round "
              f"({arm['database_bytes_after'] / 1e6:.1f} MB after {arm['rounds']} rounds; "
              f"materializations {arm['materializations']}; {arm['seconds']} s)")
    month = 30 * 24 * 3600
    for arm in arms:
        print(f"  a month at a round a second, {arm['per_partition']} a partition: "
              f"{arm['database_bytes_per_round'] * month / 1e9:.1f} GB")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    args.out.write_text(json.dumps({
        "commit": commit,
        "command": "python benchmarks/mirror_database.py " + " ".join(argv or sys.argv[1:]),
        "machine": "2-core Linux VM (the development machine), a nice 19 quality sweep beside",
        "arms": arms}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
