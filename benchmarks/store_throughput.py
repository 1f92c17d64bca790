"""Artifact-store throughput: a full set of global fragments and one contribution per encoding,
for a ~100M-parameter model, on the local backend and on a loopback GCS API server.

Per backend and repeat: commit every fragment of the global parameters (params + outer state),
then load them all back verified; then write and read back one learner contribution of the whole
model in each encoding. Reports medians over repeats (backends interleaved), MB/s of payload,
and the exact bytes of each encoding.

    python benchmarks/store_throughput.py          # ~100M params, P=4, 3 repeats
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from diloco_core.config import ENCODINGS, ModelConfig, OuterOptConfig  # noqa: E402
from diloco_core.fragments import plan_fragments, split_params  # noqa: E402
from diloco_core.learner import FragmentSync, LearnerSync  # noqa: E402
from diloco_core.model import abstract_params  # noqa: E402
from diloco_core.outer import build_outer_optimizer  # noqa: E402
from pipelines.reporting import code_revision  # noqa: E402
from resources.store.artifact_store import ArtifactStore  # noqa: E402
from resources.store.backends import open_blob_store  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results" / "store_throughput.json"


def random_params(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s.shape, dtype=np.float32) * 0.02
            for k, s in abstract_params(cfg).items()}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_backend(store: ArtifactStore, params, plan, tx, encodings, block, repeat: int) -> dict:
    fragments = split_params(params, plan)
    states = [tx.init(f) for f in fragments]
    version = repeat
    out = {}
    pairs = list(enumerate(zip(fragments, states, strict=True)))
    out["global_write_s"] = timed(
        lambda: [store.commit_global(p, version, f, s) for p, (f, s) in pairs])
    out["global_read_s"] = timed(lambda: [store.load_global(p) for p in range(len(fragments))])
    # One contribution of the whole model (a single-fragment plan) per encoding.
    moved = {k: v + 1e-3 for k, v in params.items()}
    single = plan_fragments({k: v.shape for k, v in params.items()}, 1)
    whole = LearnerSync("bench", (FragmentSync(params, 0, steps=1, tokens=4096),))
    for encoding in encodings:
        c = whole.contribution(moved, single, 0, 1000 * repeat + ENCODINGS.index(encoding),
                               1, 0.0, encoding, block)
        jax.block_until_ready([e.payload for e in c.delta.values()])
        out[f"{encoding}_bytes"] = c.nbytes
        out[f"{encoding}_write_s"] = timed(lambda c=c: store.put_contribution(c))
        out[f"{encoding}_read_s"] = timed(
            lambda c=c: store.load_contribution(c.round, c.learner))
    return out


def main(argv=None) -> dict:
    revision = code_revision()     # at the start: the code this process runs
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layers", type=int, default=14)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--backends", default="local,gcs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    cfg = ModelConfig(preset="small", vocab_size=args.vocab, d_model=args.d_model,
                      n_layers=args.n_layers, n_heads=12, d_ff=4 * args.d_model,
                      max_seq_len=1024)
    params = random_params(cfg, 0)
    n_params = sum(v.size for v in params.values())
    plan = plan_fragments({k: v.shape for k, v in params.items()}, args.fragments)
    tx = build_outer_optimizer(OuterOptConfig())
    backends = args.backends.split(",")
    stores = {}
    with contextlib.ExitStack() as stack:
        if "local" in backends:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            stores["local"] = ArtifactStore(open_blob_store(tmp), "bench")
        if "gcs" in backends:
            from gcs_emulator import gcs_emulator

            stack.enter_context(gcs_emulator())
            stores["gcs"] = ArtifactStore(
                open_blob_store(f"gs://diloco-test/bench-{uuid.uuid4().hex[:8]}"), "bench")
        runs = {name: [] for name in stores}
        for repeat in range(args.repeats):
            for name, store in stores.items():
                runs[name].append(run_backend(store, params, plan, tx, ENCODINGS,
                                              args.block_size, repeat))
                print(f"{name} repeat {repeat}: global write "
                      f"{runs[name][-1]['global_write_s']:.2f}s read "
                      f"{runs[name][-1]['global_read_s']:.2f}s", flush=True)
    fp32_bytes = n_params * 4
    results = {}
    for name, reps in runs.items():
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        results[name] = {
            "global_write_MBps": fp32_bytes / med["global_write_s"] / 1e6,
            "global_read_MBps": fp32_bytes / med["global_read_s"] / 1e6,
            "median_seconds": med,
            "contribution_MBps": {e: {"write": med[f"{e}_bytes"] / med[f"{e}_write_s"] / 1e6,
                                      "read": med[f"{e}_bytes"] / med[f"{e}_read_s"] / 1e6}
                                  for e in ENCODINGS},
        }
    first = next(iter(runs.values()))[0]
    report = {
        "benchmark": "store_throughput",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": revision,
        "command": "python benchmarks/store_throughput.py " + " ".join(argv or sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "jax": jax.__version__},
        "settings": {"parameters": int(n_params), "fp32_bytes": fp32_bytes,
                     "fragments": args.fragments, "repeats": args.repeats,
                     "block_size": args.block_size},
        "bytes_per_encoding": {e: first[f"{e}_bytes"] for e in ENCODINGS},
        "bits_per_value": {e: 8 * first[f"{e}_bytes"] / n_params for e in ENCODINGS},
        "results": results,
    }
    print(f"\n{n_params / 1e6:.1f}M parameters, P={args.fragments}, medians of {args.repeats}")
    print(f"{'backend':<8}{'global write MB/s':>20}{'global read MB/s':>20}")
    for name, r in results.items():
        print(f"{name:<8}{r['global_write_MBps']:>20.1f}{r['global_read_MBps']:>20.1f}")
    print(f"\n{'encoding':<10}{'bytes':>14}{'bits/value':>12}")
    for e in ENCODINGS:
        print(f"{e:<10}{report['bytes_per_encoding'][e]:>14,}{report['bits_per_value'][e]:>12.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
