"""Run by test_multihost.py as one process of a multi-host learner (`jax.distributed` on
loopback, gloo collectives between the processes), or alone as the single-device reference.

    python tests/multihost_check.py <process_id> <num_processes> <port> <devices> <mode>

Trains the tiny model 4 AdamW steps from the seed-0 init on the same 4 global batches as the
reference, on a learner mesh over every device of every process (state `mode`: replicated or
fsdp); process 0 prints the losses, where the arrays live and the final parameters as JSON."""

import json
import os
import sys

process_id, num_processes, port, devices, mode = sys.argv[1:6]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(devices)}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

if int(num_processes) > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(num_processes),
                               process_id=int(process_id))

from diloco_core.config import InnerOptConfig, ModelConfig  # noqa: E402
from diloco_core.inner_step import InnerStep  # noqa: E402
from diloco_core.model import init_model  # noqa: E402
from diloco_core.spmd import host_value, learner_mesh, place_state, shard_batch  # noqa: E402


def train() -> dict:
    model_def, params = init_model(ModelConfig.from_preset("tiny"), seed=0)
    inner = InnerStep(model_def, InnerOptConfig(warmup_steps=0), total_steps=10)
    mesh = learner_mesh(jax.devices())
    state = place_state(inner.init(params), mesh, mode)
    rng = np.random.default_rng(1)   # every process draws the same global batches
    losses = []
    for _ in range(4):
        batch = shard_batch(rng.integers(0, 256, (8, 33), dtype=np.int32), mesh)
        state, metrics = inner.step(state, batch)
        losses.append(float(host_value(metrics["loss"])))
    name = max(state.params, key=lambda k: state.params[k].size)
    big = state.params[name]
    full = {k: host_value(v) for k, v in sorted(state.params.items())}
    return {"process_count": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "losses": losses,
            "largest": {"name": name, "shape": list(big.shape),
                        "devices": len(big.sharding.device_set),
                        "local_shard_shapes": sorted({tuple(s.data.shape)
                                                      for s in big.addressable_shards})},
            "params": {k: v.ravel()[:64].tolist() for k, v in full.items()}}


if __name__ == "__main__":
    out = train()
    if jax.process_index() == 0:
        print(json.dumps(out), flush=True)
    if int(num_processes) > 1:
        jax.distributed.shutdown()
