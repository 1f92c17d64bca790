"""The merge of one demo-sized fragment, idle and under learners' load: what the syncer pays per
round when fragments are small and the machine is shared.

`benchmarks/merge_cost.py` measures the merge against fragment size on an idle machine, where
arithmetic dominates. The demo's fragments are small (13 tensors, 0.4M parameters) and its
syncer shares two cores with four training learners; there a merge costs its dispatches and its
waits on the host more than its arithmetic, and the idle figure says little (issue 35: the
streaming merge took 0.209 s a round in the demo against 0.151 s for the fragment-wide merge
it replaced, though idle they were 13 ms and 11 ms).

Each arm runs in a child process (this checkout, or `--checkout DIR` of an older commit, whose
packages are imported through PYTHONPATH): it builds fragment 1 of the demo's model (the
orchestrated defaults: P = 4), its outer state and four int4 contributions, compiles the merge,
then times `--reps` merges (decision to merged values ready, the syncer's `merge_fragment`).
"fragment-wide" is the merge before streaming (tests/merge_reference.py). With `--load N`, N
processes run a jitted matmul loop on one XLA thread each (as the demo's learners are pinned)
for the whole run; the arms take turns, `--rounds` times each, under the same load.

    python benchmarks/merge_under_load.py --load 4
    python benchmarks/merge_under_load.py --load 4 --checkout /tmp/old --label faf8c03
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "merge_under_load.json"
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
LOAD_LOOP = ("import jax, jax.numpy as jnp\nx = jnp.ones((384, 384))\n"
             "f = jax.jit(lambda x: jnp.tanh(x @ x) * 0.5)\n"
             "while True:\n    x = f(x).block_until_ready()\n")


def child(impl: str, reps: int) -> None:
    """One arm: print the seconds of `reps` merges as JSON."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from diloco_core.compression import encode
    from diloco_core.config import ExperimentConfig, OuterOptConfig, SyncConfig
    from diloco_core.contribution import Contribution
    from diloco_core.fragments import plan_fragments, split_params
    from diloco_core.model import init_model, is_embedding
    from diloco_core.outer import build_outer_optimizer
    from diloco_core.syncer import FragmentState, merge_fragment

    if impl == "fragment-wide":
        sys.path.insert(0, str(ROOT / "tests"))
        from merge_reference import reference_merge_fragment as merge
    else:
        merge = merge_fragment
    _, params = init_model(ExperimentConfig().model, 0)
    fragment = split_params(params, plan_fragments({k: v.shape for k, v in params.items()},
                                                   4))[1]
    rng = np.random.default_rng(0)
    offers = [Contribution(f"l{i}", 1, 1, 0, 400, 4, 4, 0.0, {
        n: encode(jnp.asarray(rng.standard_normal(v.shape).astype(np.float32) * 0.01),
                  "int4", 64) for n, v in fragment.items()}) for i in range(4)]
    tx = build_outer_optimizer(OuterOptConfig())
    args = (FragmentState(fragment, 0, tx.init(fragment), lambda _: None), list(fragment), 4,
            1, 1, offers, SyncConfig(num_fragments=4, sync_period=16, encoding="int4",
                                     min_quorum=2), tx, is_embedding, "benchmark")
    out = merge(*args)
    if len(out[2].members) != 4:
        raise SystemExit(f"the benchmark's contributions were refused: {out[2].rejected}")
    jax.block_until_ready(out[0])
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(merge(*args)[0])
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds, "tensors": len(fragment),
                      "params": int(sum(v.size for v in fragment.values()))}))


def _run_arm(code: Path, impl: str, reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "XLA_FLAGS": XLA_ONE_THREAD}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", impl,
                           "--reps", str(reps)], cwd=code, env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"median_ms": round(1000 * statistics.median(ordered), 2),
            "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 2),
            "merges": len(ordered)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=4, help="busy processes beside the merge")
    parser.add_argument("--reps", type=int, default=20, help="merges per turn")
    parser.add_argument("--rounds", type=int, default=3, help="turns per arm")
    parser.add_argument("--checkout", type=Path, help="an older commit's tree to compare")
    parser.add_argument("--label", help="the older tree's name in the results (its commit)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", choices=("streaming", "fragment-wide"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.reps)
        return {}
    from pipelines.reporting import code_revision, machine_info

    arms = [("streaming (this checkout)", ROOT, "streaming"),
            ("fragment-wide (tests/merge_reference.py)", ROOT, "fragment-wide")]
    if args.checkout:
        arms.insert(1, (f"streaming ({args.label or args.checkout})", args.checkout.resolve(),
                        "streaming"))
    loads = [subprocess.Popen([sys.executable, "-c", LOAD_LOOP],
                              env={**os.environ, "XLA_FLAGS": XLA_ONE_THREAD})
             for _ in range(args.load)]
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    shape = {}
    try:
        time.sleep(3 if loads else 0)     # the load's own start-up and compilation
        for turn in range(args.rounds):
            for name, code, impl in (arms if turn % 2 == 0 else arms[::-1]):
                result = _run_arm(code, impl, args.reps)
                seconds[name] += result["seconds"]
                shape = {"tensors": result["tensors"], "params": result["params"]}
                print(f"turn {turn}: {name}: median "
                      f"{1000 * statistics.median(result['seconds']):.1f} ms", flush=True)
    finally:
        for p in loads:
            p.kill()
    rows = {name: _summary(values) for name, values in seconds.items()}
    first = rows[arms[0][0]]["median_ms"]
    for name, row in rows.items():
        row["x_this_checkout"] = round(row["median_ms"] / first, 3)
        print(f"{name}: median {row['median_ms']} ms, p90 {row['p90_ms']} ms "
              f"({row['x_this_checkout']}x this checkout)")
    record = {"benchmark": "merge_under_load", **code_revision(),
              "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(),
                                               *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": machine_info(), "load_processes": args.load,
              "load_average_1m_at_end": os.getloadavg()[0], "fragment": shape, "arms": rows}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
