"""Inner-step throughput: a bare jitted Optax loop vs the learner loop around `InnerStep.step`.

(a) "bare": the benchmark's own `jax.jit` of loss + grad + optimizer update, same model
    (`apply_model`), same optimizer (`build_inner_optimizer`), one batch already on device, no
    metrics beyond the loss, synced once at the end of a repeat.
(b) "inner_step": the learner loop as the simulator runs it: batches from a `BatchIterator`
    (a host->device copy each step), `InnerStep.step`, the per-fragment sync counters, an encoded
    contribution of the fragment that comes due every H/P steps, and metrics pulled to the host
    every --sync-every steps.

Both are compiled and warmed up first, then timed in interleaved repeats (a, b, a, b, ...) so
drifts in machine load hit both alike. Reports median tokens/s and the ratio b / a: how much of
the bare loop's speed the production step keeps.

    python benchmarks/inner_step_throughput.py            # small preset, 16 x 128, ~1-2 min
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_core.config import InnerOptConfig, ModelConfig
from diloco_core.data import BatchIterator
from diloco_core.fragments import due_fragment, plan_fragments, split_params
from diloco_core.inner_optimizer import build_inner_optimizer
from diloco_core.inner_step import InnerStep
from diloco_core.learner import LearnerSync
from diloco_core.model import apply_model, init_model, param_count
from pipelines.reporting import code_revision

DEFAULT_OUT = Path(__file__).parent / "results" / "inner_step_throughput.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each variant")
    p.add_argument("--sync-every", type=int, default=10,
                   help="(b) pulls metrics to the host every this many steps")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--sync-period", type=int, default=16, help="H of the learner loop")
    p.add_argument("--num-fragments", type=int, default=4, help="P of the learner loop")
    p.add_argument("--encoding", default="bf16", help="outer-gradient encoding of offers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def machine_info() -> dict:
    device = jax.devices()[0]
    return {"platform": platform.platform(), "processor": platform.processor(),
            "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "backend": jax.default_backend(), "device": str(device),
            "device_kind": device.device_kind, "device_count": jax.device_count()}


def make_bare_step(model_def, optimizer: optax.GradientTransformation):
    """The reference: the textbook Optax training step, nothing else."""

    def loss_fn(params, batch):
        logits = apply_model(model_def, params, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def bare_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # Donate like InnerStep does, so neither side pays for an extra copy of the state.
    return jax.jit(bare_step, donate_argnums=(0, 1))


def main(argv: list[str] | None = None) -> dict:
    revision = code_revision()     # at the start: the code this process runs
    args = parse_args(argv)
    cfg = ModelConfig.from_preset(args.preset)
    if args.seq_len > cfg.max_seq_len:
        raise SystemExit(f"--seq-len {args.seq_len} > max_seq_len {cfg.max_seq_len} of "
                         f"{args.preset!r}")
    model_def, params = init_model(cfg, args.seed)
    inner_cfg = InnerOptConfig()
    total_steps = (args.repeats * args.steps + args.warmup_steps + 1) * 2
    optimizer = build_inner_optimizer(inner_cfg, total_steps)
    tokens_per_step = args.batch_size * args.seq_len

    rng = np.random.default_rng(args.seed)
    host_batches = rng.integers(0, cfg.vocab_size, (args.steps, args.batch_size, args.seq_len),
                                dtype=np.int32)
    device_batch = jax.device_put(host_batches[0])

    bare_step = make_bare_step(model_def, optimizer)
    bare_params = jax.tree.map(jnp.copy, params)
    bare_opt = optimizer.init(bare_params)
    inner = InnerStep(model_def, inner_cfg, total_steps)
    state = inner.init(params)

    # Compile + warm up both, outside the timings.
    compile_s = {}
    start = time.perf_counter()
    for _ in range(args.warmup_steps + 1):
        bare_params, bare_opt, loss = bare_step(bare_params, bare_opt, device_batch)
    jax.block_until_ready(loss)
    compile_s["bare"] = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(args.warmup_steps + 1):
        state, metrics = inner.step(state, host_batches[i % args.steps])
    jax.block_until_ready(metrics)
    compile_s["inner_step"] = time.perf_counter() - start

    def run_bare() -> float:
        nonlocal bare_params, bare_opt
        start = time.perf_counter()
        for _ in range(args.steps):
            bare_params, bare_opt, loss = bare_step(bare_params, bare_opt, device_batch)
        jax.block_until_ready((bare_params, loss))
        return time.perf_counter() - start

    # The learner loop's own per-step work around the step: the data iterator, the sync
    # counters, and every H/P steps an encoded contribution of the fragment that comes due.
    stream = rng.integers(0, cfg.vocab_size, tokens_per_step * (args.steps + 1) * 2,
                          dtype=np.uint8)
    data = BatchIterator(stream, args.batch_size, args.seq_len, seed=args.seed)
    plan = plan_fragments({k: v.shape for k, v in params.items()}, args.num_fragments)
    sync = LearnerSync.start("bench", split_params(params, plan), [0] * args.num_fragments)
    learner_steps = 0

    def run_inner() -> float:
        nonlocal state, sync, learner_steps
        start = time.perf_counter()
        synced = []
        for i in range(args.steps):
            state, metrics = inner.step(state, data.next())
            sync = sync.after_step(tokens_per_step)
            learner_steps += 1
            fragment = due_fragment(learner_steps, args.sync_period, args.num_fragments)
            if fragment is not None:
                offer = sync.contribution(state.params, plan, fragment, learner_steps,
                                          learner_steps, 0.0, args.encoding, 64)
                jax.block_until_ready([e.payload for e in offer.delta.values()])
            if (i + 1) % args.sync_every == 0:
                synced.append({k: float(v) for k, v in metrics.items()})
        jax.block_until_ready(state)
        return time.perf_counter() - start

    seconds = {"bare": [], "inner_step": []}
    for _ in range(args.repeats):
        seconds["bare"].append(run_bare())
        seconds["inner_step"].append(run_inner())

    results = {}
    for name, times in seconds.items():
        tps = [args.steps * tokens_per_step / t for t in times]
        results[name] = {"seconds_per_repeat": times, "tokens_per_s": tps,
                         "median_tokens_per_s": statistics.median(tps),
                         "median_ms_per_step": 1e3 * statistics.median(times) / args.steps,
                         "compile_and_warmup_s": compile_s[name]}
    ratio = results["inner_step"]["median_tokens_per_s"] / results["bare"]["median_tokens_per_s"]

    report = {
        "benchmark": "inner_step_throughput",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": revision,
        "command": "python benchmarks/inner_step_throughput.py "
                   + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(),
        "settings": {"preset": args.preset, "param_count": param_count(cfg),
                     "batch_size": args.batch_size, "seq_len": args.seq_len,
                     "tokens_per_step": tokens_per_step, "steps_per_repeat": args.steps,
                     "repeats": args.repeats, "sync_every": args.sync_every,
                     "warmup_steps": args.warmup_steps, "dtype": cfg.dtype,
                     "sync_period": args.sync_period, "num_fragments": args.num_fragments,
                     "encoding": args.encoding,
                     "order": "interleaved: bare, inner_step, bare, inner_step, ..."},
        "results": results,
        "ratio_inner_step_over_bare": ratio,
    }
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


def print_table(report: dict) -> None:
    s, m = report["settings"], report["machine"]
    print(f"preset {s['preset']} ({s['param_count']:,} params), batch {s['batch_size']} x "
          f"{s['seq_len']}, {s['repeats']} x {s['steps_per_repeat']} steps each, "
          f"on {m['device_kind']} ({m['cpu_count']} CPUs), jax {m['jax']}")
    print(f"{'variant':<12} {'median tok/s':>13} {'ms/step':>9} {'min tok/s':>10} "
          f"{'max tok/s':>10} {'compile s':>10}")
    for name, r in report["results"].items():
        print(f"{name:<12} {r['median_tokens_per_s']:>13,.0f} {r['median_ms_per_step']:>9.1f} "
              f"{min(r['tokens_per_s']):>10,.0f} {max(r['tokens_per_s']):>10,.0f} "
              f"{r['compile_and_warmup_s']:>10.2f}")
    print(f"ratio inner_step / bare (median tok/s): {report['ratio_inner_step_over_bare']:.3f}")


if __name__ == "__main__":
    main()
