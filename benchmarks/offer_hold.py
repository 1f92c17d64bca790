"""How long a learner's offer holds its training loop, at 132M parameters (issue 37).

An offer, as the learner runtime makes it between two inner steps: the fragment's delta against
its anchor, encoded (`LearnerSync.contribution`); under the rebase receive rule a copy of what
was offered (`after_offer`); then the upload thread turns the encoded arrays into bytes while
the loop trains on. The loop itself only dispatches that work, but on the same device it runs
before or beside the next step. So the hold is measured as a loop iteration would feel it:

    plain:  step, wait for it
    offer:  offer (as the runtime does it) + step, wait for both, with a thread pulling the
            encoded payload to the host meanwhile (the upload thread's copy)
    work:   the offer alone, waited for (its delta, encoding, rebase copy and host copy)
    copy:   the fragment's parameters copied out of device memory: the floor the issue sets
            ("none beyond the copy out of device memory")
    dispatch: within "offer", the time until the offer's calls return (JAX runs them
            asynchronously: on an accelerator this is the loop's own share of the hold)

interleaved (plain, offer, work, copy, plain, ...) so drifts in machine load hit all alike.
Reported: medians, hold = offer - plain, and work / copy.

    python benchmarks/offer_hold.py                  # 132M parameters, P = 2: ~10 min on 2 cores
    bash benchmarks/offer_hold_device.sh DIR         # the same settings on an accelerator
"""

import argparse
import json
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import jax
import numpy as np

from diloco_core.config import InnerOptConfig, ModelConfig
from diloco_core.fragments import plan_fragments, split_params
from diloco_core.inner_step import InnerStep
from diloco_core.learner import LearnerSync
from diloco_core.model import init_model, param_count
from pipelines.reporting import code_revision, machine_info

DEFAULT_OUT = Path(__file__).parent / "results" / "offer_hold.json"
# GPT-2-small-like widths (a gated MLP of 2048), a 30k vocabulary, untied embeddings: 132M.
SHAPE = dict(vocab_size=30_720, d_model=768, n_layers=12, n_heads=12, d_ff=2048,
             max_seq_len=128)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-fragments", type=int, default=2)
    p.add_argument("--encoding", default="bf16", choices=("bf16", "int4", "fp32"))
    p.add_argument("--receive-rule", default="rebase", choices=("rebase", "overwrite"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    revision = code_revision()
    args = parse_args(argv)
    cfg = ModelConfig.from_preset("small", **SHAPE)
    model_def, params = init_model(cfg, 0)
    inner = InnerStep(model_def, InnerOptConfig(), 1000)
    state = inner.init(params)
    plan = plan_fragments({k: v.shape for k, v in params.items()}, args.num_fragments)
    sync = LearnerSync.start("bench", split_params(params, plan), [0] * args.num_fragments)
    fragment = 0
    fragment_params = sum(int(np.prod(params[k].shape)) for k in plan.fragments[fragment])
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.vocab_size, (args.batch_size, args.seq_len), dtype=np.int32)

    def plain() -> float:
        nonlocal state
        start = time.perf_counter()
        state, metrics = inner.step(state, batch)
        jax.block_until_ready((state, metrics))
        return time.perf_counter() - start

    def offer() -> float:
        nonlocal state, sync
        start = time.perf_counter()
        contribution = sync.contribution(state.params, plan, fragment, 0, int(state.step), 0.0,
                                         args.encoding, 64)
        if args.receive_rule == "rebase":
            sync = sync.after_offer(state.params, plan, fragment, 0)
        # JAX dispatches asynchronously: what the calls above cost the loop before the device
        # runs anything (tracing, one dispatch per tensor and operation).
        seconds["dispatch"].append(time.perf_counter() - start)
        upload = threading.Thread(target=lambda: jax.device_get(
            {k: e.payload for k, e in contribution.delta.items()}))
        upload.start()
        state, metrics = inner.step(state, batch)
        jax.block_until_ready((state, metrics))
        held = time.perf_counter() - start
        upload.join()                  # the upload thread's copy, if the step finished first
        return held

    def work() -> float:
        """The offer's own work, waited for, without a step beside it."""
        start = time.perf_counter()
        contribution = sync.contribution(state.params, plan, fragment, 0, int(state.step), 0.0,
                                         args.encoding, 64)
        kept = (sync.after_offer(state.params, plan, fragment, 0)
                if args.receive_rule == "rebase" else None)
        jax.device_get(({k: e.payload for k, e in contribution.delta.items()},
                        None if kept is None else kept.fragments[fragment].offered_values))
        return time.perf_counter() - start

    def copy() -> float:
        # On the CPU backend `device_get` hands out a view of the same memory; the copy a
        # device would make is a real one.
        start = time.perf_counter()
        for k in plan.fragments[fragment]:
            np.array(state.params[k], copy=True)
        return time.perf_counter() - start

    started = time.perf_counter()
    seconds = {"plain": [], "offer": [], "work": [], "copy": [], "dispatch": []}
    plain(), offer(), work(), copy()   # compile and warm up
    warmup = time.perf_counter() - started
    seconds["dispatch"].clear()
    for _ in range(args.repeats):
        for name, run in (("plain", plain), ("offer", offer), ("work", work), ("copy", copy)):
            seconds[name].append(run())
    med = {k: statistics.median(v) for k, v in seconds.items()}
    hold = med["offer"] - med["plain"]
    report = {
        "benchmark": "offer_hold",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": revision,
        "command": "python benchmarks/offer_hold.py " + " ".join(argv or sys.argv[1:]),
        "machine": {**machine_info(), "backend": jax.default_backend(),
                    "device": jax.devices()[0].device_kind, "jax": jax.__version__},
        "settings": {"model": SHAPE, "param_count": param_count(cfg),
                     "fragment_params": fragment_params, "num_fragments": args.num_fragments,
                     "batch_size": args.batch_size, "seq_len": args.seq_len,
                     "encoding": args.encoding, "receive_rule": args.receive_rule,
                     "repeats": args.repeats, "warmup_s": warmup,
                     "order": "interleaved: plain, offer, work, copy, plain, ..."},
        "seconds": seconds, "median_seconds": med,
        "hold_seconds": hold, "hold_over_copy": hold / med["copy"],
        "work_over_copy": med["work"] / med["copy"],
    }
    print(f"{param_count(cfg) / 1e6:.0f}M parameters, fragment {fragment_params / 1e6:.0f}M "
          f"(P = {args.num_fragments}), {args.encoding} offers, {args.receive_rule} rule, "
          f"{args.repeats} repeats on {jax.default_backend()}")
    print(f"step {med['plain']:.2f} s; step with an offer {med['offer']:.2f} s; "
          f"hold {hold:.2f} s; the offer's work alone {med['work']:.3f} s; the fragment's "
          f"copy out of device memory {med['copy']:.3f} s (work / copy "
          f"{med['work'] / med['copy']:.1f}); the offer's calls return after "
          f"{med['dispatch']:.3f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
