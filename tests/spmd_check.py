"""Run in a fresh interpreter by test_spmd.py: JAX must see 4 host devices, which is fixed when
it initialises. Trains the tiny model 4 steps on one device and on a 4-device learner mesh
(state replicated, then FSDP-sharded), from the same init and batches, and prints the figures
to compare as JSON."""

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
from diloco_core.spmd import learner_mesh, place_state, shard_batch  # noqa: E402


def _specs(state) -> list[str]:
    return [str(getattr(x.sharding, "spec", "single device")) for x in jax.tree.leaves(state)]


def train(preset: str, mesh=None, mode: str = "replicated") -> dict:
    model_def, params = init_model(ModelConfig.from_preset(preset), seed=0)
    inner = InnerStep(model_def, InnerOptConfig(warmup_steps=0), total_steps=10)
    state = inner.init(params)
    placed = None
    if mesh is not None:
        state = place_state(state, mesh, mode)
        placed = _specs(state)
    rng = np.random.default_rng(1)
    losses, shards = [], None
    for _ in range(4):
        batch = rng.integers(0, 256, (8, 33), dtype=np.int32)
        if mesh is not None:
            batch = shard_batch(batch, mesh)
            shards = len({s.device for s in batch.addressable_shards})
        state, metrics = inner.step(state, batch)
        losses.append(float(metrics["loss"]))
    # The largest matrix (the embedding): how much of it one device holds after the steps.
    name = max(state.params, key=lambda k: state.params[k].size)
    big = state.params[name]
    out = {"losses": losses, "batch_devices": shards,
           "param_devices": len(big.sharding.device_set),
           "largest": {"name": name, "shape": list(big.shape),
                       "shard_shapes": sorted({tuple(s.data.shape)
                                               for s in big.addressable_shards})},
           # The step keeps the placement it was given (no silent all-gather of the state).
           "sharding_kept": placed is None or placed == _specs(state),
           "sharded_leaves": sum("data" in s for s in _specs(state))}
    params = jax.device_get(state.params)
    out["params"] = {k: np.asarray(v).ravel()[:64].tolist() for k, v in sorted(params.items())}
    return out


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
                      "fsdp": train(preset, learner_mesh(), "fsdp"),
                      "uneven_batch_error": uneven_batch_error()}))
