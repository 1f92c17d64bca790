"""Where the streaming merge's time goes, stage by stage, on one 4M-parameter tensor (issue 37).

`merge_cost.py` times whole merges; this times the programs a merge of one 2048 x 2048 tensor
runs (`diloco_core/merge_stream.py`), each on its own, compiled first, the median of
`--repeats` calls each waited for: pass 1 (per member: decode, finite check, norm parts),
pass 2's decode of the [M, 2048, 2048] stack, the combine (RDA), the diagnostic cosine's Gram
matrix on the host, the outer step (Nesterov, op by op as the merge runs it) and the update's
norm parts. A large fragment is 64 such tensors a 256M parameters; each is a group of its own,
so the merge's time is about the sum of the stages times the tensor count.

In the same run, for scale: a numpy copy (bytes read + written a second), and the time to
read every member's contribution and write the merged tensor at that rate (merge_cost.py's
bound). The ratio of each stage to the bound says where the merge is far from memory speed.

    python benchmarks/merge_profile.py                        # M = 8, int4 and bf16
    python benchmarks/merge_profile.py --members 4 --encodings int4 --repeats 3
"""

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from merge_cost import BYTES_PER_PARAM, TENSOR, memory_bandwidth  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "merge_profile.json"
SHAPE = (2048, 2048)


def _median_s(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())          # compiled, and the caches warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(members: int, encoding: str, repeats: int) -> dict:
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from diloco_core import merge_stream as ms
    from diloco_core.compression import Encoded
    from diloco_core.config import OuterOptConfig
    from diloco_core.outer import PACKED, build_outer_optimizer, outer_step, pack_outer_state

    rng = np.random.default_rng(0)
    params = jnp.asarray(rng.standard_normal(SHAPE, dtype=np.float32) * 0.02)
    tx = build_outer_optimizer(OuterOptConfig())
    state = tx.init({"w": params})

    def encoded() -> Encoded:       # as merge_cost.py makes them
        if encoding == "int4":
            return Encoded("int4", SHAPE, 64,
                           jnp.asarray(rng.integers(0, 256, TENSOR // 2, dtype=np.uint8)),
                           jnp.asarray(rng.uniform(1e-5, 1e-4, TENSOR // 64).astype(np.float32)))
        bits = (rng.integers(0, 1 << 16, TENSOR, dtype=np.uint16) & 0x807F) | 0x3C00
        return Encoded("bf16", SHAPE, 64, jnp.asarray(bits.view(ml_dtypes.bfloat16)
                                                      .reshape(SHAPE)), None)

    offers = [encoded() for _ in range(members)]
    wire = ms._Wire.of(offers[0])
    weights = jnp.asarray(np.full(members, 1.0 / members), jnp.float32)
    payloads = (tuple(e.payload for e in offers),)
    scales = (tuple(e.scales for e in offers),)
    stacks = ms._decoded_stacks(payloads, scales, (wire,))
    merged = ms._combine(stacks, weights, ("rda",), "none")[0]
    packed_state = pack_outer_state(state, frozenset(["w"]), lambda d: d["w"])
    stages = {
        "pass 1: decode, finite, norm parts (x M)": lambda: [
            ms._group_stats((e.payload,), (e.scales,), (None,), (None,), (wire,))
            for e in offers],
        "pass 2: decode the [M, ...] stack": lambda: ms._decoded_stacks(payloads, scales,
                                                                         (wire,)),
        "combine: RDA": lambda: ms._combine(stacks, weights, ("rda",), "none"),
        "cosine: Gram matrix on the host": lambda: ms._host_gram(stacks),
        "outer step (Nesterov, op by op)": lambda: outer_step(
            tx, {PACKED: params}, packed_state, {PACKED: merged}),
        "update's norm parts": lambda: ms._difference_stats((params,), (params,)),
    }
    seconds = {name: _median_s(fn, repeats) for name, fn in stages.items()}
    return {"members": members, "encoding": encoding, "tensor_values": TENSOR,
            "repeats": repeats, "stage_s": {k: round(v, 4) for k, v in seconds.items()},
            "total_s": round(sum(seconds.values()), 4)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--encodings", default="int4,bf16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    from pipelines.reporting import code_revision, machine_info

    bandwidth = memory_bandwidth()
    rate = bandwidth["median_gb_s"] * 1e9
    points = []
    for encoding in args.encodings.split(","):
        point = profile(args.members, encoding, args.repeats)
        moved = TENSOR * (args.members * BYTES_PER_PARAM[encoding] + 4)
        point["bound_s"] = round(moved / rate, 5)
        point["total_x_bound"] = round(point["total_s"] / point["bound_s"], 1)
        points.append(point)
        print(f"M = {args.members}, {encoding}: {point['total_s'] * 1e3:.0f} ms a 4M tensor, "
              f"{point['total_x_bound']}x the bound ({point['bound_s'] * 1e3:.1f} ms at "
              f"{bandwidth['median_gb_s']} GB/s)")
        for name, s in point["stage_s"].items():
            print(f"  {name:44s} {s * 1e3:7.1f} ms  {s / point['total_s']:5.1%}  "
                  f"{s / point['bound_s']:6.1f}x the bound")
    result = {"benchmark": "merge_profile", "timestamp": datetime.now(UTC).isoformat(),
              **code_revision(), "command": "python benchmarks/merge_profile.py "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info(), "memory_bandwidth": bandwidth, "points": points}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
