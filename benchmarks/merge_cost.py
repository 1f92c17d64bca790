"""Merge cost against fragment size: time and peak memory of the syncer's merge of one fragment.

Each point runs in a fresh subprocess: it builds one fragment of 4M-parameter float32 tensors
(2048 x 2048; 1M: one 1024 x 1024), its outer state (the default Nesterov outer optimizer) and M
synthetic contributions (random int4 codes and scales, or random finite bf16 values, every one
admitted), then calls the core merge (`diloco_core.syncer.merge_fragment`, what the syncer
service and the simulator call) once to compile and `--repeats` times measured. Per repeat: wall
time, and peak resident memory over the resident memory just before the call (polled from
/proc every 2 ms; the process's ru_maxrss delta as a cross-check). The peak reported is the
largest over the repeats, which is the first's: after a call the allocator keeps the pages it
freed, so a later call's peak over its own starting point understates the merge's working set
(the median is kept beside it). Each point imports this checkout's code (`PYTHONPATH`), not
whatever the environment installed, so two checkouts can be compared side by side. "old" is
the fragment-wide merge the streaming one replaced (tests/merge_reference.py), run only where
it fits (<= 64M).

The machine's limit is measured in the same run: a numpy copy of 1 GiB, as bytes moved (read +
written) per second; the bound for a merge is the time to read every contribution and write
the result (4 bytes a parameter) at that rate. Points whose set-up plus an allowance for the
merge would exceed the memory cap (default 8.5 GB) are skipped and listed.

    python benchmarks/merge_cost.py --big-repeats 1   # the full curve (~1 h on 2 shared cores)
    python benchmarks/merge_cost.py --quick        # 1M and 4M, M = 2 and 4, int4, one repeat
"""

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "merge_cost.json"
TENSOR = 4 * 1024 * 1024                       # values per tensor (2048 x 2048)
BYTES_PER_PARAM = {"int4": 0.5 + 4 / 64, "bf16": 2.0}   # wire bytes (int4: codes + scales)
OLD_MAX_PARAMS = 64 * 1024 * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Polls this process's resident memory in a thread while the block runs."""

    def __enter__(self):
        self.base = _rss()
        self.maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak, self._stop = self.base, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.maxrss_delta = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                                - self.maxrss_before)


def memory_bandwidth(size: int = 1 << 30, repeats: int = 5) -> dict:
    """numpy copy of `size` bytes: bytes moved (read + write) per second, median and best."""
    import numpy as np

    src = np.ones(size // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)        # touch every page first
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        rates.append(2 * size / (time.perf_counter() - start))
    return {"copy_bytes": size, "repeats": repeats,
            "median_gb_s": round(statistics.median(rates) / 1e9, 2),
            "best_gb_s": round(max(rates) / 1e9, 2)}


def _tensor_shapes(params: int) -> list[tuple[int, int]]:
    if params < TENSOR:
        side = int(params ** 0.5)
        return [(side, params // side)]
    return [(2048, 2048)] * (params // TENSOR)


def run_point(params: int, members: int, encoding: str, impl: str, repeats: int) -> dict:
    """One point, in this (fresh) process."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from diloco_core.compression import Encoded
    from diloco_core.config import OuterOptConfig, SyncConfig
    from diloco_core.contribution import Contribution
    from diloco_core.outer import build_outer_optimizer
    from diloco_core.syncer import FragmentState, merge_fragment

    if impl == "old":
        sys.path.insert(0, str(ROOT / "tests"))
        from merge_reference import reference_merge_fragment as merge
    else:
        merge = merge_fragment
    rng = np.random.default_rng(0)
    shapes = _tensor_shapes(params)
    names = [f"blocks/{i}/mlp/w" for i in range(len(shapes))]
    fragment = {n: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02)
                for n, s in zip(names, shapes, strict=True)}
    tx = build_outer_optimizer(OuterOptConfig())
    outer = tx.init(fragment)

    def encoded(shape) -> Encoded:
        n = shape[0] * shape[1]
        if encoding == "int4":
            codes = jnp.asarray(rng.integers(0, 256, n // 2, dtype=np.uint8))
            scales = jnp.asarray(rng.uniform(1e-5, 1e-4, n // 64).astype(np.float32))
            return Encoded("int4", shape, 64, codes, scales)
        # Random finite bf16: random sign and mantissa, exponent fixed near 2^-7.
        bits = (rng.integers(0, 1 << 16, n, dtype=np.uint16) & 0x807F) | 0x3C00
        return Encoded("bf16", shape, 64, jnp.asarray(bits.view(ml_dtypes.bfloat16)
                                                      .reshape(shape)), None)

    offers = [Contribution(f"learner-{m}", 0, 0, 0, 4096, 16, 16, 0.0,
                           {n: encoded(s) for n, s in zip(names, shapes, strict=True)})
              for m in range(members)]
    cfg = SyncConfig(num_fragments=1, sync_period=16, encoding=encoding, max_norm_ratio=1e9)
    state = FragmentState(fragment, 0, outer, lambda _: None)
    bytes_in = sum(c.nbytes for c in offers)
    gc.collect()
    setup_rss = _rss()

    def call():
        out = merge(state, names, 1, 0, 0, offers, cfg, tx, lambda _: False, "benchmark")
        jax.block_until_ready(out[:2])
        assert out[2].merged and len(out[2].members) == members, out[2]
        return out

    # Compile first. The streaming merge's programs are per tensor shape and member count, so
    # one tensor of the same shape compiles them all; the old merge compiles per fragment.
    start = time.perf_counter()
    with PeakRss() as first_mem:
        if impl == "new":
            warm = FragmentState({names[0]: fragment[names[0]]}, 0,
                                 tx.init({names[0]: fragment[names[0]]}), lambda _: None)
            out = merge(warm, names[:1], 1, 0, 0,
                        [Contribution(c.learner, 0, 0, 0, c.tokens, c.steps, c.steps, 0.0,
                                      {names[0]: c.delta[names[0]]}) for c in offers],
                        cfg, tx, lambda _: False, "warm-up")
            jax.block_until_ready(out[:2])
        else:
            out = call()
    first_s = time.perf_counter() - start
    del out
    times, peaks, maxrss = [], [], []
    for _ in range(repeats):
        gc.collect()
        with PeakRss() as mem:
            start = time.perf_counter()
            out = call()
            times.append(time.perf_counter() - start)
        peaks.append(mem.peak - mem.base)
        maxrss.append(mem.maxrss_delta)
        del out
    fp32 = 4 * params
    return {"params": params, "tensors": len(shapes), "members": members,
            "encoding": encoding, "impl": impl, "repeats": repeats,
            "bytes_in": bytes_in, "setup_rss_gb": round(setup_rss / 1e9, 3),
            "warm_up": "one tensor" if impl == "new" else "the whole fragment",
            "warm_up_s": round(first_s, 3),
            "warm_up_peak_over_setup_gb": round((first_mem.peak - first_mem.base) / 1e9, 3),
            "merge_s": [round(t, 4) for t in times],
            "merge_s_median": round(statistics.median(times), 4),
            "peak_over_setup_gb": [round(p / 1e9, 3) for p in peaks],
            "peak_over_setup_gb_median": round(statistics.median(peaks) / 1e9, 3),
            "peak_over_setup_gb_max": round(max(peaks) / 1e9, 3),
            "peak_over_setup_x_fp32_fragment": round(max(peaks) / fp32, 2),
            "ru_maxrss_delta_gb": [round(p / 1e9, 3) for p in maxrss]}


def _estimated_gb(params: int, members: int, encoding: str, impl: str) -> float:
    """Set-up (fragment, momentum, contributions) plus an allowance for the merge itself: ~3
    fragments streaming, ~(2.5 M + 8) for the old merge (issue 37's measurements)."""
    fp32 = 4 * params
    setup = 2 * fp32 + members * BYTES_PER_PARAM[encoding] * params
    extra = 3 * fp32 if impl == "new" else (2.5 * members + 6) * fp32
    return (setup + extra) / 1e9 + 0.6      # + the interpreter and JAX


def _commit() -> tuple[str, bool]:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "diloco_core",
                            "benchmarks/merge_cost.py", "tests/merge_reference.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head, bool(dirty)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", type=lambda s: [int(float(x) * 2**20) for x in s.split(",")],
                        help="fragment sizes in Mi parameters, comma-separated")
    parser.add_argument("--members", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--encodings", type=lambda s: s.split(","))
    parser.add_argument("--impls", type=lambda s: s.split(","), default=["new", "old"])
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--big-repeats", type=int, help="repeats above --small parameters")
    parser.add_argument("--small", type=float, default=32, help="Mi parameters (see above)")
    parser.add_argument("--old-max", type=float, default=64,
                        help="Mi parameters: the largest fragment the old merge runs on")
    parser.add_argument("--memory-cap-gb", type=float, default=8.5)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--point", help=argparse.SUPPRESS)   # params,members,encoding,impl,repeats
    args = parser.parse_args()
    if args.point:
        p, m, e, impl, r = args.point.split(",")
        print(json.dumps(run_point(int(p), int(m), e, impl, int(r))))
        return
    sizes = args.sizes or ([2**20, 4 * 2**20] if args.quick
                           else [s * 2**20 for s in (1, 4, 16, 32, 64, 128, 256)])
    members = args.members or ([2, 4] if args.quick else [2, 4, 8, 16])
    encodings = args.encodings or (["int4"] if args.quick else ["int4", "bf16"])
    repeats = args.repeats or (1 if args.quick else 3)
    bandwidth = memory_bandwidth()
    print(f"memory bandwidth (numpy copy, read + write): {bandwidth['median_gb_s']} GB/s "
          f"median, {bandwidth['best_gb_s']} best", flush=True)
    points, skipped = [], []

    def write(points, skipped):     # after every point: a long run interrupted keeps its points
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(_result(args, bandwidth, points, skipped), indent=1)
                            + "\n")

    for params in sizes:
        for encoding in encodings:
            for m in members:
                for impl in args.impls:
                    if impl == "old" and params > min(OLD_MAX_PARAMS,
                                                       args.old_max * 2**20):
                        continue
                    need = _estimated_gb(params, m, encoding, impl)
                    label = f"{params / 2**20:g}M M={m} {encoding} {impl}"
                    if need > args.memory_cap_gb:
                        skipped.append(f"{label}: needs ~{need:.1f} GB > {args.memory_cap_gb}")
                        print(f"skip {skipped[-1]}", flush=True)
                        continue
                    r = (repeats if params <= args.small * 2**20
                         else args.big_repeats or repeats)
                    proc = subprocess.run(
                        [sys.executable, __file__, "--point",
                         f"{params},{m},{encoding},{impl},{r}"],
                        cwd=ROOT, capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join(
                            [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
                    if proc.returncode != 0:
                        skipped.append(f"{label}: failed: {proc.stderr.strip()[-300:]}")
                        print(f"FAILED {skipped[-1]}", flush=True)
                        continue
                    point = json.loads(proc.stdout.strip().splitlines()[-1])
                    point["load_average_1min"] = round(os.getloadavg()[0], 1)
                    bound = (point["bytes_in"] + 4 * params) / (bandwidth["median_gb_s"] * 1e9)
                    point["bandwidth_bound_s"] = round(bound, 4)
                    point["x_bandwidth_bound"] = round(point["merge_s_median"] / bound, 1)
                    points.append(point)
                    print(f"{label}: {point['merge_s_median']:.3f} s "
                          f"({point['x_bandwidth_bound']}x the bound), peak "
                          f"+{point['peak_over_setup_gb_max']:.2f} GB "
                          f"({point['peak_over_setup_x_fp32_fragment']}x the fp32 fragment)",
                          flush=True)
        write(points, skipped)
    write(points, skipped)
    print(f"wrote {args.out}")


def _result(args, bandwidth, points, skipped) -> dict:
    head, dirty = _commit()
    return {
        "benchmark": "merge_cost", "commit": head, "tree_dirty": dirty,
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
        "machine": {"cores": os.cpu_count(), "memory_gb": round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
                    "platform": platform.platform(), "python": platform.python_version()},
        "note": args.note, "memory_bandwidth": bandwidth,
        "bound": "time to read every contribution's wire bytes and write the result (4 bytes a "
                 "parameter) at the measured copy rate (bytes moved per second)",
        "peak_memory": "resident memory polled every 2 ms during the call, minus resident "
                       "memory just before it (the fragment, its outer state and the "
                       "contributions are set-up); the largest over repeats (the first call's: the "
                       "allocator keeps what a call freed), the median beside it",
        "points": points, "skipped": skipped}


if __name__ == "__main__":
    main()
