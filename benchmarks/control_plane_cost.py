"""The control plane's cost per round against the number of learners M (issue 37).

The real syncer service (`SyncerService`: lease, round controller, in-process merge, retention)
runs against a store that M synthetic learners use as real ones do, without training: each
round every learner writes a heartbeat with progress and offers a prepared int4 contribution
(unique bytes per round) to the open round. The syncer polls every 0.25 s, four polls a round:
one round a second while the learners' writes take less than a second (at 256 learners on
these 2 cores they take longer; the syncer's cost per round is four polls either way). The
learners write between the syncer's polls, not during them, so that the syncer's CPU time is
its own.

What the syncer does is counted on its own store object, wrapped here (not in product code):
store operations by kind, bytes read, listing pages (GCS pages hold up to 1000 objects; a
local listing is one directory walk), process CPU seconds and wall time of each controller tick
(the reads, the machine's step and its writes), and each round's decision -> published latency
(the merge record's `published_at - decided_at`). Warm-up rounds (the merge compiling for
each fragment) are left out.

Each (backend, M) runs in a fresh interpreter, for the code at HEAD ("after") and, with
`--baseline REF`, for REF checked out into a temporary git worktree ("before"), interleaved.
Backends: `local`, the local filesystem store; `gcs`, the loopback GCS API server the tests use
(`tests/gcs_emulator.py`, in its own process so its CPU time is not the syncer's; it serves one
request at a time, so concurrent reads cannot overlap there); `latency20`, the local store with
20 ms of waiting added to each of the syncer's requests, standing in for a cloud bucket's round
trips (which a bucket serves many at once).

    python benchmarks/control_plane_cost.py --baseline f098828 --backends local,latency20,gcs
    python benchmarks/control_plane_cost.py --quick                      # M = 4, 16; local
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "control_plane_cost.json"
POLLS_PER_ROUND = 4          # syncer_poll_seconds = 0.25: one round a second
EMULATOR = """
import sys
sys.path.insert(0, sys.argv[1])
from gcs_emulator import gcs_emulator
with gcs_emulator() as url:
    print(url, flush=True)
    sys.stdin.read()
"""


# ---- the child: one backend, one M, one checkout ------------------------------------------------
def _counting(inner, delay: float = 0.0):
    """The syncer's blob store, counted (every call delegated unchanged). `delay`: seconds of
    waiting added to every request, as a network round trip adds (the loopback GCS server
    answers in about a millisecond, one request at a time; a cloud bucket takes tens of
    milliseconds and serves many at once)."""
    from resources.store.blobs import BlobStore

    class Counting(BlobStore):
        # A latency-added local store stands for a bucket: the GCS backend's concurrency
        # (where the code has one).
        read_concurrency = getattr(inner, "read_concurrency", 1)
        if delay and hasattr(inner, "read_concurrency"):
            from resources.store.gcs_blobs import READ_CONCURRENCY as read_concurrency

        def __init__(self):
            self.inner, self.lock = inner, threading.Lock()
            self.counts: dict[str, float] = {}

        def _add(self, **kw):
            time.sleep(delay)
            with self.lock:
                for k, v in kw.items():
                    self.counts[k] = self.counts.get(k, 0) + v

        @property
        def uri(self):
            return inner.uri

        def write(self, key, data, *, if_generation=None):
            self._add(writes=1, bytes_written=len(data))
            return inner.write(key, data, if_generation=if_generation)

        def read(self, key):
            try:
                data = inner.read(key)
            except Exception:
                self._add(reads=1)      # a miss is a request too
                raise
            self._add(reads=1, bytes_read=len(data))
            return data

        def info(self, key):
            self._add(infos=1)
            return inner.info(key)

        def list(self, prefix, *, limit=None):
            keys = inner.list(prefix, limit=limit)
            self._add(lists=1, list_pages=max(1, math.ceil(len(keys) / 1000)),
                      listed=len(keys))
            return keys

        def delete(self, key, *, forget=False):
            self._add(deletes=1)
            return inner.delete(key, forget=forget)

        def snapshot(self):
            with self.lock:
                return dict(self.counts)

    return Counting()


@contextlib.contextmanager
def _emulator(wanted: bool, code: Path):
    """A fresh loopback GCS server (this checkout's, for both variants) in its own process:
    its CPU time is not the syncer's, and a fresh one per run since its listings slow down
    with everything it holds."""
    if not wanted:
        yield
        return
    server = subprocess.Popen([sys.executable, "-c", EMULATOR, str(code / "tests")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        url = server.stdout.readline().strip()
        os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                          GOOGLE_CLOUD_PROJECT="test", GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
        yield
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def _child(args) -> dict:
    sys.path[:0] = [str(args.code), str(args.code / "tests")]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from learner_store_setup import committed_experiment
    from synthetic_learners import SyntheticLearners

    import pipelines
    from pipelines.syncer.service import SyncerService
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store
    assert Path(pipelines.__file__).resolve().is_relative_to(args.code.resolve()), (
        pipelines.__file__)
    M, P = args.learners, 2
    overrides = ["model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
                 f"learners.num_learners={M}", f"sync.num_fragments={P}", "sync.sync_period=4",
                 "sync.encoding=int4",
                 f"sync.min_quorum={max(1, M // 2)}", "sync.max_speed_ratio=inf",
                 "token_budget=1000000000000", "orchestration.syncer=service",
                 "orchestration.eval_every_rounds=1000000"]
    with tempfile.TemporaryDirectory() as tmp, _emulator(args.backend == "gcs", ROOT):
        uri = (f"gs://diloco-test/cp-{uuid.uuid4().hex[:8]}" if args.backend == "gcs"
               else str(Path(tmp) / "store"))
        learners_store = committed_experiment(uri, "cp", overrides)
        cfg_map = learners_store.get_config()
        from diloco_core.config_loading import config_from_mapping
        cfg = config_from_mapping(cfg_map)
        names = list(cfg.learners.learner_names)
        learners = SyntheticLearners(learners_store, cfg)
        beat, offer = learners.beat, learners.offer

        delay = (int(args.backend[len("latency"):]) / 1e3
                 if args.backend.startswith("latency") else 0.0)
        counted = _counting(open_blob_store(uri), delay)
        service = SyncerService(ArtifactStore(counted, "cp"), attempt=0)
        service.lease.acquire(cfg.orchestration.syncer_timeout_seconds)
        ticks: list[dict] = []
        tick = service.controller.tick

        def timed_tick(state, now=None):
            before, cpu, wall = counted.snapshot(), time.process_time(), time.perf_counter()
            result = tick(state, now)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            after = counted.snapshot()
            ticks.append({"wall_s": wall, "cpu_s": cpu, **{
                k: after.get(k, 0) - before.get(k, 0) for k in after}})
            return result
        service.controller.tick = timed_tick

        pool = ThreadPoolExecutor(8)     # the learners' writes (between polls)
        offered, rounds, learner_s = -1, [], []
        for n in names:
            beat(n)
        for i in range(args.warmup + args.rounds):
            start, first_tick = time.perf_counter(), len(ticks)
            # Every learner beats each round with the steps it made; and offers to a round
            # that opened since its last offer.
            learners.advance()
            list(pool.map(beat, names))
            open_round = learners_store.latest_open_round()
            if open_round is not None and open_round.round > offered:
                r = offered = open_round.round
                version = learners_store.current_version(r % P)
                list(pool.map(offer, names, [r] * M, [version] * M))
            learner_s.append(time.perf_counter() - start)
            merges_before = len(_tally(service).decision_to_publish)
            step_cpu, step_wall = time.process_time(), time.perf_counter()
            for _ in range(POLLS_PER_ROUND):
                poll = time.perf_counter()
                service.step()
                time.sleep(max(0.0, cfg.orchestration.syncer_poll_seconds
                               - (time.perf_counter() - poll)))
            if i >= args.warmup:
                mine = ticks[first_tick:]
                rounds.append({
                    "round": offered, "ticks": len(mine),
                    "syncer_cpu_s": time.process_time() - step_cpu,
                    "syncer_wall_s": time.perf_counter() - step_wall,
                    "decision_to_published_s": _tally(service).decision_to_publish[merges_before:],
                    **{k: sum(t.get(k, 0) for t in mine) for k in (
                        "reads", "bytes_read", "infos", "lists", "list_pages", "listed",
                        "writes", "bytes_written", "deletes", "cpu_s", "wall_s")}})
                rounds[-1]["tick_cpu_s"] = rounds[-1].pop("cpu_s")
                rounds[-1]["tick_wall_s"] = rounds[-1].pop("wall_s")
        pool.shutdown()
        measured = ticks[-sum(r["ticks"] for r in rounds):]
    return {"learners": M, "backend": args.backend, "rounds": rounds, "ticks": measured,
            "learner_write_s_median": statistics.median(learner_s),
            "merged": _tally(service).merged, "state_round": service.state.get("round")}


def _tally(service):
    """What the service has done: `service.progress` since 4a4a28c (the counters were the
    service's own attributes before, as in a `--baseline` from then)."""
    return getattr(service, "progress", service)


# ---- the parent: every (backend, M), before and after, and the summary -------------------------
def _pct(values, q):
    values = sorted(values)
    if not values:
        return None
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def _summary(run: dict) -> dict:
    ticks, rounds = run["ticks"], run["rounds"]
    ops = ("reads", "infos", "lists", "writes", "deletes")
    latency = [x for r in rounds for x in r["decision_to_published_s"]]
    per_round = {k: statistics.mean(r[k] for r in rounds) for k in (
        *ops, "bytes_read", "list_pages", "bytes_written", "tick_cpu_s", "syncer_cpu_s")}
    per_round["store_ops"] = sum(per_round[k] for k in ops)
    return {
        "rounds_measured": len(rounds), "ticks_measured": len(ticks),
        "merged_rounds": len(latency),
        "per_tick": {
            "store_ops_mean": statistics.mean(sum(t.get(k, 0) for k in ops) for t in ticks),
            "reads_mean": statistics.mean(t.get("reads", 0) for t in ticks),
            "bytes_read_mean": statistics.mean(t.get("bytes_read", 0) for t in ticks),
            "list_pages_mean": statistics.mean(t.get("list_pages", 0) for t in ticks),
            "cpu_s_mean": statistics.mean(t["cpu_s"] for t in ticks),
            "wall_s_median": statistics.median(t["wall_s"] for t in ticks),
            "wall_s_p99": _pct([t["wall_s"] for t in ticks], 0.99),
        },
        "per_round": per_round,
        "decision_to_published_s": {"p50": _pct(latency, 0.5), "p99": _pct(latency, 0.99)},
        "learner_writes_s_median": run["learner_write_s_median"],
    }


def _run_child(code: Path, backend: str, learners: int, args, env) -> dict:
    # Each checkout's own child drives its own store API (records typed or not): the figures
    # compare because the child of every commit measures them the same way.
    script = code / "benchmarks" / "control_plane_cost.py"
    script = script if script.exists() else Path(__file__).resolve()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(script), "--child", "--code", str(code),
               "--backend", backend, "--learners", str(learners), "--rounds",
               str(args.rounds), "--warmup", str(args.warmup), "--out", out.name]
        subprocess.run(cmd, check=True, env=env, cwd=code)
        return json.loads(Path(out.name).read_text())


def _git(*argv, cwd=ROOT) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def _machine() -> dict:
    """`pipelines.reporting.machine_info`, plus what a cost curve on a shared machine needs:
    its memory and the load when the run began."""
    from pipelines.reporting import machine_info

    meminfo = Path("/proc/meminfo")
    lines = meminfo.read_text().splitlines() if meminfo.exists() else []
    mem = next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemTotal")),
               None)
    return {**machine_info(), "memory_bytes": mem, "load_average_at_start": os.getloadavg(),
            "shared": "yes: other engineers' tests and a long-running soak ran beside it"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", default="4,16,64,256")
    parser.add_argument("--backends", default="local,latency20,gcs")
    parser.add_argument("--rounds", type=int, default=12, help="measured rounds per run")
    parser.add_argument("--warmup", type=int, default=4, help="rounds left out (compiling)")
    parser.add_argument("--gcs-max-learners", type=int, default=64,
                        help="the loopback GCS server is one Python thread: larger M there "
                             "measures the server")
    parser.add_argument("--baseline", help="a git ref measured as 'before' (a worktree)")
    parser.add_argument("--quick", action="store_true",
                        help="M = 4, 16 on the local store, 5 rounds: a smoke run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--code", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.learners = int(args.learners)
        args.out.write_text(json.dumps(_child(args)))
        return {}
    if args.quick:
        args.learners, args.backends, args.rounds, args.warmup = "4,16", "local", 5, 3
    learners = [int(x) for x in args.learners.split(",")]
    backends = args.backends.split(",")
    head = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    variants = {"after": ROOT}
    tmp = tempfile.mkdtemp(prefix="cp-baseline-")
    try:
        if args.baseline:
            base = _git("rev-parse", args.baseline)
            _git("worktree", "add", "--detach", f"{tmp}/tree", base)
            variants = {"before": Path(tmp) / "tree", "after": ROOT}
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        results = {b: {v: {} for v in variants} for b in backends}
        for backend in backends:
            for m in learners:
                if backend == "gcs" and m > args.gcs_max_learners:
                    continue
                for variant, code in variants.items():
                    run = _run_child(code, backend, m, args, env)
                    s = results[backend][variant][str(m)] = _summary(run)
                    pt, lat = s["per_tick"], s["decision_to_published_s"]
                    print(f"{backend:5} {variant:6} M={m:<4} ops/tick {pt['store_ops_mean']:6.1f} "
                          f"reads/tick {pt['reads_mean']:6.1f} cpu/tick "
                          f"{pt['cpu_s_mean'] * 1e3:6.1f} ms  wall p50/p99 "
                          f"{pt['wall_s_median'] * 1e3:6.1f}/{pt['wall_s_p99'] * 1e3:6.1f} ms  "
                          f"decision->published p50 "
                          f"{(lat['p50'] or float('nan')) * 1e3:6.1f} ms  merged "
                          f"{s['merged_rounds']}/{s['rounds_measured']}", flush=True)
    finally:
        if args.baseline:
            subprocess.run(["git", "worktree", "remove", "--force", f"{tmp}/tree"], cwd=ROOT,
                           check=False, capture_output=True)
    report = {
        "benchmark": "control_plane_cost",
        "commit": head, "uncommitted_changes": dirty,
        "baseline": _git("rev-parse", args.baseline) if args.baseline else None,
        "command": "python " + " ".join([str(Path(sys.argv[0])), *(argv or sys.argv[1:])]),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "settings": {"learners": learners, "backends": backends, "rounds": args.rounds,
                     "gcs_max_learners": args.gcs_max_learners,
                     "warmup_rounds": args.warmup, "polls_per_round": POLLS_PER_ROUND,
                     "model": "tiny, P=2, int4, K=M//2"},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
