"""Run in a fresh interpreter by test_spmd.py: JAX must see 4 host devices, which is fixed when
it initialises. Trains the tiny model 4 steps on one device and on a 4-device learner mesh, from
the same init and batches, and prints the figures to compare as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from diloco_core.config import InnerOptConfig, ModelConfig  # noqa: E402
from diloco_core.inner_step import InnerStep  # noqa: E402
from diloco_core.model import init_model  # noqa: E402
from diloco_core.spmd import learner_mesh, replicate, shard_batch  # noqa: E402


def train(preset: str, mesh=None) -> dict:
    model_def, params = init_model(ModelConfig.from_preset(preset), seed=0)
    inner = InnerStep(model_def, InnerOptConfig(warmup_steps=0), total_steps=10)
    state = inner.init(params)
    if mesh is not None:
        state = replicate(state, mesh)
    rng = np.random.default_rng(1)
    losses, shards = [], None
    for _ in range(4):
        batch = rng.integers(0, 256, (8, 33), dtype=np.int32)
        if mesh is not None:
            batch = shard_batch(batch, mesh)
            shards = len({s.device for s in batch.addressable_shards})
        state, metrics = inner.step(state, batch)
        losses.append(float(metrics["loss"]))
    params = jax.device_get(state.params)
    first = next(iter(state.params.values()))
    return {"losses": losses, "batch_devices": shards,
            "param_devices": len(first.sharding.device_set),
            "params": {k: np.asarray(v).ravel()[:64].tolist() for k, v in sorted(params.items())}}


def uneven_batch_error() -> str | None:
    try:
        shard_batch(np.zeros((6, 33), np.int32), learner_mesh())
    except ValueError as err:
        return str(err)
    return None


if __name__ == "__main__":
    preset = sys.argv[1]
    print(json.dumps({"devices": jax.device_count(), "single": train(preset),
                      "mesh": train(preset, learner_mesh()),
                      "uneven_batch_error": uneven_batch_error()}))
