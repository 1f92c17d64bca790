"""A long haul of the syncer service: many rounds, what grows and what stays flat (issue 37).

The real syncer (`python -m pipelines.syncer.entry`, its own process: lease, round controller,
merge, retention) runs an experiment against a local store while M synthetic learners in this
process use it as real ones do, without training: each round every learner writes a heartbeat
with its progress, and once the syncer opens the round every learner offers a prepared int4
contribution (its scales nudged each round, so that no two offers carry the same bytes). Time
is compressed: the syncer polls every 0.02 s instead of 0.25 s and the learners offer as soon
as a round opens, so rounds run back to back as fast as the syncer decides, merges and
publishes them (the protocol waits on nothing else here: every learner offers every round).

Every `--sample-every` rounds it records the syncer's resident memory and CPU seconds
(/proc), the store's objects and bytes (a walk of the directory), and the rounds' decision ->
published latency (each round's decision record against its version's `published_at`) and
period over the window. At the end: each series' slope over the run (least squares), and a
month at the paper's cadence (a round a second, 2,592,000 rounds) projected from it.

At the end it times the run's token ledger two ways on the store the haul left: archived
rounds' fates from their blocks' digests (what a run does) and every round's records parsed,
and checks that both give the same ledger.

With `--dagster` the syncer runs as the product runs it: launched as a Dagster run by the
learner supervisor on an instance with its daemon, code server and webserver, while the quorum
sensor mirrors every round into the instance (`haul_dagster.py`); each sample then adds the
instance's memory, database and runs, and the sensor's tick times. `--heap-probe` adds the
code server's allocator seen from inside its gRPC process (`heap_probe/sitecustomize.py`):
Python's allocated blocks and glibc's heap in use and free, which tell an accumulating
allocation from freed memory the allocator keeps.

    python benchmarks/long_haul.py --rounds 5000           # ~15 min on 2 cores
    python benchmarks/long_haul.py --dagster --rounds 6000 --sample-every 300
    python benchmarks/long_haul.py --rounds 100000 --sample-every 5000
"""

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from learner_store_setup import committed_experiment  # noqa: E402
from synthetic_learners import SyntheticLearners  # noqa: E402

from diloco_core.config_loading import config_from_mapping  # noqa: E402
from pipelines.commands.status import run_status  # noqa: E402
from pipelines.reporting import code_revision, machine_info  # noqa: E402
from pipelines.token_ledger import run_ledger  # noqa: E402
from resources.compute.local import DEFAULT_XLA_FLAGS, local_env  # noqa: E402
from resources.store.artifact_store import ArtifactStore  # noqa: E402
from resources.store.backends import open_blob_store  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "long_haul.json"
MONTH_ROUNDS = 30 * 24 * 3600      # the paper's cadence: a fragment round every second
EXPERIMENT = "haul"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5000, help="merged rounds to run")
    p.add_argument("--learners", type=int, default=16)
    p.add_argument("--sample-every", type=int, default=250, help="rounds between samples")
    p.add_argument("--poll-seconds", type=float, default=0.02, help="the syncer's poll")
    p.add_argument("--dagster", action="store_true",
                   help="the syncer launched by the learner supervisor on a Dagster instance "
                        "(daemon, code server, webserver), the quorum sensor mirroring "
                        "every round; writes long_haul_dagster.json unless --out is given")
    p.add_argument("--dagster-arenas", type=int, default=None,
                   help="MALLOC_ARENA_MAX for the Dagster processes (code server, daemon, "
                        "webserver); default: unset, as `diloco dev` runs them")
    p.add_argument("--dagster-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the Dagster processes (repeatable), "
                        "e.g. PYTHONMALLOC=malloc")
    p.add_argument("--heap-probe", action="store_true",
                   help="with --dagster: sample the code server's allocator from inside "
                        "(Python's blocks, the heap in use and free; benchmarks/heap_probe/)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.heap_probe and not args.dagster:
        p.error("--heap-probe needs --dagster (it samples the code server)")
    if args.out is None:
        args.out = DEFAULT_OUT.with_name("long_haul_dagster.json") if args.dagster else DEFAULT_OUT
    return args


def _proc(pid: int | None) -> tuple[float | None, float | None]:
    """(resident MB, CPU seconds) of process `pid`; (None, None) when there is none (the
    syncer between a crash and its relaunch)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return None, None
    rss_kb = next(int(line.split()[1]) for line in status.splitlines()
                  if line.startswith("VmRSS:"))
    ticks = os.sysconf("SC_CLK_TCK")
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / ticks


def _store_size(root: Path) -> tuple[int, int, dict, int]:
    """(objects, bytes, {kind: [objects, bytes]}, directories): a kind is an object's path with
    its round, version and learner numbers replaced by `N` (`rounds/N/contributions/
    learner-N/...`). Directories are a local store's own cost (an inode each)."""
    objects = size = directories = 0
    kinds: dict[str, list[int]] = {}
    for dirpath, _, files in os.walk(root):
        directories += 1
        for f in files:
            try:
                n = os.stat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                continue        # pruned while walking
            objects, size = objects + 1, size + n
            k = kinds.setdefault(_kind(os.path.relpath(os.path.join(dirpath, f), root)), [0, 0])
            k[0], k[1] = k[0] + 1, k[1] + n
    return objects, size, kinds, directories


def _kind(path: str) -> str:
    """`rounds/r12/contributions/learner-3/delta-9f3ab2c1.npz` -> `rounds/rN/contributions/
    learner-N/delta-H.npz`: hashes (8 or more hex digits) to H, other numbers to N."""
    return re.sub(r"\d+", "N", re.sub(r"[0-9a-f]{8,}", "H", path))


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * len(values))) - 1))] if values else None


def _slope(xs, ys) -> float | None:
    """Least-squares slope of ys against xs (None with fewer than 3 points)."""
    if len(xs) < 3:
        return None
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


# What the Dagster instance adds to each sample, fitted and projected as the syncer's figures.
DAGSTER_SERIES = ("dagster_home_bytes", "dagster_database_bytes", "dagster_db_ticks_bytes",
                  "dagster_db_runs_bytes", "dagster_db_mirror_events_bytes",
                  "dagster_db_event_index_bytes", "dagster_db_run_events_bytes", "dagster_runs",
                  "syncer_standby_rss_mb",
                  "daemon_rss_mb", "code_server_rss_mb", "webserver_rss_mb", "run_worker_rss_mb",
                  # With --heap-probe: the code server's gRPC process from inside.
                  "grpc_rss_mb", "grpc_rss_anon_mb", "grpc_rss_file_mb", "grpc_rss_shmem_mb",
                  "grpc_main_heap_mb", "grpc_unnamed_mb", "grpc_unnamed_maps",
                  "grpc_python_blocks", "grpc_heap_in_use_mb", "grpc_heap_free_mb",
                  "grpc_threads", "grpc_mmap_chunks", "grpc_mmap_chunks_mb")


def _dagster_line(s: dict) -> str:
    if "dagster_database_bytes" not in s:
        return ""
    tick = s.get("sensor_tick_p50_s")
    return (f"  dagster db {s['dagster_database_bytes'] / 1e6:.1f} MB home "
            f"{s['dagster_home_bytes'] / 1e6:.1f} MB runs {s['dagster_runs']} daemon "
            f"{s.get('daemon_rss_mb', 0):.0f} MB code server "
            f"{s.get('code_server_rss_mb', 0):.0f} MB standby "
            f"{s.get('syncer_standby_rss_mb', 0):.0f} MB sensor ticks {s['sensor_ticks']}"
            + ("" if tick is None else f" p50 {tick * 1e3:.0f} ms")
            + ("" if "grpc_heap_free_mb" not in s else
               f"  gRPC process {s['grpc_rss_mb']:.0f} MB (anon {s['grpc_rss_anon_mb']:.0f}: "
               f"main heap {s['grpc_main_heap_mb']:.0f}, unnamed {s['grpc_unnamed_mb']:.0f} in "
               f"{s['grpc_unnamed_maps']:.0f} maps), glibc heap in use "
               f"{s['grpc_heap_in_use_mb']:.1f} MB free {s['grpc_heap_free_mb']:.1f} MB, "
               f"{s['grpc_python_blocks']:.0f} Python blocks"))


def _opened_after(store, offered: int):
    rnd = store.latest_open_round()
    return rnd if rnd is not None and rnd.round > offered else None


def _newer_version(store, fragment: int, version: int) -> int | None:
    current = store.current_version(fragment)
    return current if current is not None and current > version else None


class PlainSyncer:
    """The syncer service as its own process against a local store, started by the haul."""

    def __init__(self, tmp: Path, overrides: list[str]):
        self.store_root, self.log_path = tmp / "store", tmp / "syncer.log"
        self.overrides = overrides
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "PlainSyncer":
        self.store = committed_experiment(str(self.store_root), EXPERIMENT, self.overrides)
        # The environment the product launches its syncer with (`LearnerCompute`: one XLA
        # thread, two malloc arenas); the hauls before 2026-11-27 ran it with neither.
        env = {**os.environ, **local_env(DEFAULT_XLA_FLAGS, {}), "DILOCO_SYNCER_STANDBY": "0",
               "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipelines.syncer.entry", "--store", str(self.store_root),
                 "--experiment", EXPERIMENT], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)     # gives its lease back
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def syncer_pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def sample(self) -> dict:
        return {}

    def relaunches(self) -> int:
        return 0

    def log_tail(self) -> list[str]:
        return self.log_path.read_text().splitlines()[-5:]


def _dagster_side(tmp: Path, overrides: list[str], names: list[str], arenas: int | None,
                  heap_probe: bool, extra: list[str]):
    from haul_dagster import DagsterSide

    env = {} if arenas is None else {"MALLOC_ARENA_MAX": str(arenas)}
    env |= dict(item.split("=", 1) for item in extra)
    probe = None
    if heap_probe:
        probe = tmp / "heap_probe.jsonl"
        paths = [str(Path(__file__).parent / "heap_probe"), os.environ.get("PYTHONPATH", "")]
        env |= {"PYTHONPATH": os.pathsep.join(p for p in paths if p),
                "DILOCO_HEAP_PROBE": str(probe)}
    return DagsterSide(tmp, overrides, names, EXPERIMENT, extra_env=env, heap_probe=probe)


def _wait(predicate, timeout: float, what: str, alive):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if not alive():
            raise RuntimeError(f"the syncer (or the instance running it) ended waiting for "
                               f"{what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.002)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # SIGTERM ends it like Ctrl-C: the syncer, in its own session, is stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    revision = code_revision()
    M, P = args.learners, 2
    overrides = ["model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
                 f"learners.num_learners={M}", f"sync.num_fragments={P}", "sync.sync_period=4",
                 "sync.encoding=int4", f"sync.min_quorum={max(1, M // 2)}",
                 "sync.max_speed_ratio=inf", "token_budget=1000000000000",
                 "orchestration.syncer=service", "orchestration.eval_every_rounds=1000000000",
                 f"orchestration.syncer_poll_seconds={args.poll_seconds}"]
    if args.dagster:
        # The grouping a month's run at a round a second gets (`rounds_per_partition`'s
        # automatic choice for 2.6 million rounds, P = 2): partitions complete within the haul,
        # so the mirror's digests are in it (with this budget the automatic choice is larger).
        overrides.append("orchestration.rounds_per_partition=260")
    names = list(config_from_mapping({}, overrides).learners.learner_names)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        side = stack.enter_context(_dagster_side(Path(tmp), overrides, names,
                                                 args.dagster_arenas, args.heap_probe,
                                                 args.dagster_env)
                                   if args.dagster
                                   else PlainSyncer(Path(tmp), overrides))
        root = side.store_root
        if args.dagster:
            # `train` commits the experiment; the supervisor then launches the syncer's run.
            _wait(lambda: side.train_succeeded() is not None, 600, "the train run", side.alive)
            if not side.train_succeeded():
                raise SystemExit("the train run failed: see the instance's logs")
            store = ArtifactStore(open_blob_store(str(root)), EXPERIMENT)
        else:
            store = side.store
        cfg = config_from_mapping(store.get_config())
        learners = SyntheticLearners(store, cfg, scale_step=1e-6)
        pool = ThreadPoolExecutor(8)
        samples, window, offered, merged, last_kinds = [], [], -1, 0, {}
        started = time.monotonic()
        try:
            while merged < args.rounds:
                t0 = time.monotonic()
                learners.advance()
                list(pool.map(learners.beat, learners.names))
                # The first round waits for the syncer to start (on Dagster: its run's launch).
                rnd = _wait(functools.partial(_opened_after, store, offered),
                            120 if merged else 600, f"round {offered + 1} to open", side.alive)
                r = offered = rnd.round
                version = store.current_version(r % P)
                list(pool.map(learners.offer, learners.names, [r] * M, [version] * M))
                new = _wait(functools.partial(_newer_version, store, r % P, version), 120,
                            f"round {r}'s merge", side.alive)
                decision, meta = store.get_decision(r), store.version_meta(r % P, new)
                window.append({"period_s": time.monotonic() - t0,
                               "latency_s": meta.latency(decision.decided_at)
                               if decision is not None and meta is not None else None})
                merged += 1
                if merged % args.sample_every == 0 or merged == args.rounds:
                    rss, cpu = _proc(side.syncer_pid())
                    objects, size, kinds, directories = _store_size(root)
                    status_started = time.perf_counter()
                    run_status(store)
                    status_s = time.perf_counter() - status_started
                    lat = [w["latency_s"] for w in window if w["latency_s"] is not None]
                    periods = [w["period_s"] for w in window]
                    samples.append({
                        "rounds": merged, "round": r, "elapsed_s": time.monotonic() - started,
                        "syncer_rss_mb": rss, "syncer_cpu_s": cpu,
                        "store_objects": objects, "store_bytes": size,
                        "store_directories": directories,
                        "latency_p50_s": _pct(lat, 0.5), "latency_p99_s": _pct(lat, 0.99),
                        "period_median_s": statistics.median(periods),
                        "status_s": status_s, **side.sample()})
                    if args.dagster:
                        samples[-1]["dagster_home_bytes"] = _store_size(side.home)[1]
                    window = []
                    last_kinds = kinds
                    s = samples[-1]
                    print(f"{merged:>7} rounds {s['elapsed_s']:7.0f}s  syncer {rss or 0:6.0f} MB "
                          f"{cpu or 0:7.1f} cpu-s  store {objects:>8} objects {size / 1e6:8.1f} MB "
                          f"{directories:>6} dirs  "
                          f"decision->published p50 {s['latency_p50_s'] * 1e3:5.1f} ms p99 "
                          f"{s['latency_p99_s'] * 1e3:6.1f} ms  round "
                          f"{s['period_median_s'] * 1e3:5.1f} ms  status {status_s * 1e3:.0f} ms"
                          + _dagster_line(s), flush=True)
        finally:
            pool.shutdown()
            tail = side.log_tail()
            relaunches = side.relaunches()
            stack.close()             # the syncer (and the instance) stop before the ledger
        # The end of a run's accounting, timed on the store as the haul left it, two ways
        # side by side: the archived rounds' fates from their blocks' digests (what a run
        # does), and every round's records parsed (decision, merge, each offer's manifest).
        # Both must give the same ledger.
        ledger_started = time.perf_counter()
        by_digest = run_ledger(ArtifactStore(store.blobs, store.experiment), cfg)
        ledger_s = time.perf_counter() - ledger_started
        records_started = time.perf_counter()
        by_records = run_ledger(ArtifactStore(store.blobs, store.experiment), cfg,
                                digests=False)
        records_s = time.perf_counter() - records_started
        if (by_digest[0].summary(), by_digest[1]) != (by_records[0].summary(), by_records[1]):
            raise SystemExit("the ledger from the digests differs from the records' ledger")
    # Slopes over the samples after the first (the first holds the start: compiling, warming).
    later, last = samples[1:], samples[-1]
    slopes = {k: _slope([s["rounds"] for s in later if s.get(k) is not None],
                        [s[k] for s in later if s.get(k) is not None]) for k in (
        "syncer_rss_mb", "store_objects", "store_bytes", "store_directories", "latency_p99_s",
        "latency_p50_s", "syncer_cpu_s", "status_s", *DAGSTER_SERIES, "sensor_tick_p50_s")
        if k in last}
    # Projected only for what accumulates; the latencies' slopes are reported as they are.
    month = {k: (None if slopes[k] is None
                 else last[k] + max(0.0, slopes[k]) * (MONTH_ROUNDS - last["rounds"]))
             for k in ("syncer_rss_mb", "store_objects", "store_bytes", "store_directories",
                       *DAGSTER_SERIES) if k in slopes}
    report = {
        "benchmark": "long_haul",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": revision,
        "command": "python benchmarks/long_haul.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(),
        "settings": {"learners": M, "fragments": P, "rounds": args.rounds,
                     "sample_every": args.sample_every, "syncer_poll_seconds": args.poll_seconds,
                     "keep_global_versions": cfg.orchestration.keep_global_versions,
                     "keep_contribution_rounds": cfg.orchestration.keep_contribution_rounds,
                     "model": "tiny", "encoding": "int4", "dagster": args.dagster,
                     "syncer_relaunches": relaunches,
                     "syncer_env": local_env(DEFAULT_XLA_FLAGS, {}),
                     "dagster_malloc_arena_max": args.dagster_arenas,
                     "code_server_heap_probe": args.heap_probe,
                     "dagster_env": args.dagster_env},
        "samples": samples,
        "slopes_per_round": slopes,
        "month_rounds": MONTH_ROUNDS,
        "month_projection": month,
        # With digests the ledger parses the records of the rounds not yet archived (the
        # retention window and the block being filled: a fixed number) and reads one digest
        # per 64 rounds before them, so its time is not a per-round figure to project.
        "run_ledger_s": ledger_s,
        # The same ledger with every round's records parsed (no digests), for comparison:
        # this one grows with the rounds.
        "run_ledger_records_s": records_s,
        "run_ledger_records_s_per_round": records_s / max(1, merged),
        "run_ledger_records_s_month": records_s / max(1, merged) * MONTH_ROUNDS,
        # What the store holds at the end, by kind of object, largest count first. (Not per
        # round: with retention and the archive most kinds are a window that does not grow;
        # what grows is in the slopes above.)
        "store_by_kind": dict(sorted(last_kinds.items(), key=lambda kv: -kv[1][0])),
        "syncer_log_tail": tail,
    }
    print("per 1000 rounds: " + ", ".join(
        f"{k} {v * 1000:+.4g}" for k, v in slopes.items() if v is not None))
    print("a month at a round a second: " + ", ".join(
        f"{k} {v:.4g}" for k, v in month.items() if v is not None))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"the run's token ledger took {ledger_s:.1f} s (archived rounds from their blocks' "
          f"digests); parsing every round's records instead: {records_s:.1f} s "
          f"({records_s / max(1, merged) * 1e3:.2f} ms a round; a month's rounds: "
          f"{records_s / max(1, merged) * MONTH_ROUNDS / 3600:.1f} h)")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
