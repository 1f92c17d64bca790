"""Data parallelism inside one learner: its inner step over all devices of its slice (SPMD).

A learner on a TPU slice (or any multi-device host) is itself data-parallel: its batch is split
along a one-axis device mesh ("data"), its parameters and AdamW state are replicated, and the
same jitted inner step (`inner_step.py`) runs on every device. XLA's SPMD partitioner inserts
the gradient all-reduce, so the update equals the single-device update on the whole batch up to
floating-point summation order. Nothing else in the learner changes: contributions, merges and
checkpoints see ordinary (replicated) arrays.
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def learner_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over `devices` (default: every local device)."""
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("a learner mesh needs at least one device")
    return Mesh(np.array(devices), (DATA_AXIS,))


def shard_batch(batch, mesh: Mesh):
    """Split every array of a batch (text [B, L], or images and labels) along its batch axis."""
    size = mesh.shape[DATA_AXIS]

    def put(x):
        x = np.asarray(x)
        if x.shape[0] % size:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by the {size} devices "
                             "of the learner's mesh")
        return jax.device_put(x, NamedSharding(mesh, P(DATA_AXIS)))

    return jax.tree.map(put, batch)


def replicate(tree, mesh: Mesh):
    """Place a pytree (params, a `TrainState`) on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
