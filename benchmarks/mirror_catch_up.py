"""How long the quorum sensor's mirror takes to catch up with a syncer that ran on without it
(a daemon restarted after an outage, a sensor paused): issue 37's per-tick cost, at a lag.

For each lag D, a local store holds D rounds decided over two fragments, each merged into the
next version of its fragment (small arrays: the mirror reads manifests and records, never the
arrays). A fresh mirror then catches up with `mirror_tick`, 64 rounds a tick, as the sensor
does; counted on the store object: version manifests read, and the wall time of each tick.

"walk back" is the search each round's fate had before the forward search: from the
fragment's current version back to the round's own (`GlobalVersions.find_round_commit`,
reached here by giving `next_round_commit` no starting point). At a lag of D it reads about
D / 2 manifests for each round of a tick, so only its first tick is timed (the catch-up's
slowest), not the whole catch-up.

    python benchmarks/mirror_catch_up.py                      # lags 1,000 / 4,000 / 16,000
    python benchmarks/mirror_catch_up.py --lags 500 --quick   # a check of the script
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from mirror_store_setup import commit_rounds  # noqa: E402

from diloco_core.config import ExperimentConfig  # noqa: E402
from pipelines.reporting import code_revision, machine_info  # noqa: E402
from pipelines.round_mirror import MAX_ROUNDS_PER_TICK, mirror_tick  # noqa: E402
from resources.store.artifact_store import ArtifactStore  # noqa: E402
from resources.store.backends import open_blob_store  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "mirror_catch_up.json"


class CountedReads:
    """Counts the version manifests the mirror reads on this store object; with `walk_back`
    every search starts from the current version, as before the forward search."""

    def __init__(self, store: ArtifactStore, walk_back: bool):
        self.reads = 0
        version_meta, next_round_commit = store.version_meta, store.next_round_commit

        def counted(fragment, version=None):
            self.reads += 1
            return version_meta(fragment, version)

        store.version_meta = counted
        if walk_back:
            store.next_round_commit = (lambda fragment, round_index, current, after=None:
                                       next_round_commit(fragment, round_index, current, None))


def _tick(store: ArtifactStore, cfg: ExperimentConfig, state: dict | None) -> tuple[dict, float]:
    started = time.perf_counter()
    result = mirror_tick(store, cfg, state)
    seconds = time.perf_counter() - started
    return json.loads(json.dumps(result.state)), seconds      # the cursor, as the sensor keeps it


def run_lag(lag: int, quick: bool) -> dict:
    cfg = ExperimentConfig()
    with tempfile.TemporaryDirectory() as tmp:
        blobs = open_blob_store(str(Path(tmp) / "store"))
        started = time.perf_counter()
        commit_rounds(ArtifactStore(blobs, "exp"), lag)
        built_s = time.perf_counter() - started

        old_store = ArtifactStore(blobs, "exp")
        old = CountedReads(old_store, walk_back=True)
        _, old_first_s = _tick(old_store, cfg, None)

        store = ArtifactStore(blobs, "exp")
        new = CountedReads(store, walk_back=False)
        state, ticks, first_reads = None, [], None
        while state is None or state["fates"] < lag:
            state, seconds = _tick(store, cfg, state)
            ticks.append(seconds)
            first_reads = new.reads if first_reads is None else first_reads
            if quick and len(ticks) >= 3:
                break
    return {"lag_rounds": lag, "store_built_s": round(built_s, 1),
            "walk_back_first_tick_s": round(old_first_s, 3),
            "walk_back_first_tick_reads": old.reads,
            "forward_first_tick_s": round(ticks[0], 3),
            "forward_first_tick_reads": first_reads,
            "forward_ticks": len(ticks), "forward_catch_up_s": round(sum(ticks), 2),
            "forward_tick_median_s": round(statistics.median(ticks), 3),
            "forward_tick_max_s": round(max(ticks), 3),
            "forward_reads": new.reads,
            "forward_reads_per_round": round(new.reads / (MAX_ROUNDS_PER_TICK * len(ticks)
                                                          if quick else lag), 2)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lags", default="1000,4000,16000",
                        help="rounds the mirror is behind, comma-separated")
    parser.add_argument("--quick", action="store_true", help="three forward ticks a lag")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    points = []
    for lag in (int(x) for x in args.lags.split(",")):
        point = run_lag(lag, args.quick)
        points.append(point)
        p = point
        print(f"lag {lag:>6} rounds: walk back, first tick {p['walk_back_first_tick_s']:7.2f} s "
              f"{p['walk_back_first_tick_reads']:>7} reads | forward, first tick "
              f"{p['forward_first_tick_s']:6.3f} s {p['forward_first_tick_reads']:>4} reads, "
              f"{p['forward_ticks']} ticks {p['forward_catch_up_s']:7.1f} s in all, "
              f"{p['forward_reads_per_round']} reads a round", flush=True)
    result = {"benchmark": "mirror_catch_up", "timestamp": datetime.now(UTC).isoformat(),
              **code_revision(), "command": "python benchmarks/mirror_catch_up.py "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info(), "rounds_per_tick": MAX_ROUNDS_PER_TICK,
              "fragments": 2, "backend": "local filesystem", "points": points}
    if not args.quick:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
