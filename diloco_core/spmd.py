"""Data parallelism inside one learner: its inner step over all devices of its slice (SPMD).

A learner on a TPU slice (or any multi-device host) is itself data-parallel: its batch is split
along a one-axis device mesh ("data") and the same jitted inner step (`inner_step.py`) runs on
every device. XLA's SPMD partitioner inserts the collectives, so the update equals the
single-device update on the whole batch up to floating-point summation order.

Its state (params, AdamW moments) is placed in one of two ways (`learners.sharding`):
- "replicated": a full copy on every device; the gradient all-reduce is the only collective.
- "fsdp": every array split along the same "data" axis on one of its dimensions (ZeRO-3 style),
  so each device holds ~1/N of the parameters and optimizer state. XLA gathers a weight where
  the forward/backward pass needs it and reduce-scatters its gradient; the update itself runs
  on the local shard. Memory per device drops by ~N at the cost of more collective traffic.
Nothing else in the learner changes: contributions, merges and checkpoints see ordinary jax
arrays (`host_value` assembles the full value).

A learner on a multi-host slice is one JAX program in several processes (`jax.distributed`,
one per host): its mesh is over `jax.devices()`, every device of every process. The same
functions place its state and batches (each process transfers only the shards its own devices
hold) and the same jitted step runs; `host_value` gathers an array that spans processes.
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
SHARDING_MODES = ("replicated", "fsdp")


def learner_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over `devices` (default: every local device)."""
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("a learner mesh needs at least one device")
    return Mesh(np.array(devices), (DATA_AXIS,))


def shard_batch(batch, mesh: Mesh):
    """Split every array of a batch (text [B, L], or images and labels) along its batch axis.

    On a one-device mesh the host arrays come back as they are: the jitted step's own copy to
    its one device is cheaper than an explicit `device_put` (~0.15 ms a step on CPU, measured
    on the tiny model), so a single-device learner pays nothing for going through the mesh."""
    size = mesh.shape[DATA_AXIS]
    if size == 1:
        return jax.tree.map(np.asarray, batch)
    sharding = NamedSharding(mesh, P(DATA_AXIS))   # once per batch: this runs every step

    def put(x):
        x = np.asarray(x)
        if x.shape[0] % size:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by the {size} devices "
                             "of the learner's mesh")
        # Each process hands over only the rows its own devices hold (on a multi-host mesh
        # the others' devices are not addressable from here).
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, batch)


def replicate(tree, mesh: Mesh):
    """Place a pytree (params, a `TrainState`) on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def fsdp_spec(shape: Sequence[int], size: int) -> P:
    """Shard on the largest dimension divisible by `size` (the first such, on a tie): the
    largest one leaves the most even, contiguous shards. Replicated when no dimension divides
    (scalars such as step counters, odd-sized vectors), and on a one-device mesh."""
    if size > 1:
        dims = [d for d in range(len(shape)) if shape[d] % size == 0]
        if dims:
            axis = max(dims, key=lambda d: (shape[d], -d))
            return P(*([None] * axis), DATA_AXIS)
    return P()


def fsdp(tree, mesh: Mesh):
    """Place a pytree FSDP-sharded: each array by `fsdp_spec`. AdamW's moments have their
    parameter's shape, so they get the same split and the update stays local to a shard."""
    size = mesh.shape[DATA_AXIS]
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(np.shape(x), size))), tree)


def host_value(x) -> np.ndarray:
    """The full value of an array as numpy, wherever its shards live: a plain copy when this
    process holds all of it (or a full replica), else gathered from every process of the
    learner (a collective: every process must call it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def place_state(tree, mesh: Mesh, mode: str = "replicated"):
    """Place a learner's state on its mesh by `mode` ("replicated" or "fsdp").

    Arrays already placed as asked are not copied, so re-placing a state after one of its
    fragments was replaced (a merge) only moves the new arrays."""
    if mode == "replicated":
        return replicate(tree, mesh)
    if mode == "fsdp":
        return fsdp(tree, mesh)
    raise ValueError(f"unknown sharding mode {mode!r} (expected one of {SHARDING_MODES})")


def state_shardings(tree, mesh: Mesh, mode: str = "replicated"):
    """Where `place_state(tree, mesh, mode)` puts each array, without placing anything: the
    shardings an abstract restore target carries, so that every process of a multi-host
    learner reads back only its own shards of a checkpoint."""
    if mode == "replicated":
        return jax.tree.map(lambda x: NamedSharding(mesh, P()), tree)
    if mode == "fsdp":
        size = mesh.shape[DATA_AXIS]
        return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), size)), tree)
    raise ValueError(f"unknown sharding mode {mode!r} (expected one of {SHARDING_MODES})")
