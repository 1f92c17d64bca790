"""The processes of one multi-host learner agreeing on what the leader (process 0) saw.

A learner on a multi-host slice is one JAX program in several processes (`jax.distributed`).
Only the leader talks to the store, so every decision that depends on what it read (a round
opened, a fragment merged, stop, fenced) or on its clock must reach the followers before any
of them acts on it: otherwise one process would take a jitted step that another skips, and the
collectives inside it would hang or mix different programs. `Lockstep` broadcasts the leader's
values (small integer vectors, or arrays whose shapes every process knows from the fragment
plan); in a single-process learner every call hands its argument back untouched.
"""

from typing import Any

import jax
import numpy as np


class Lockstep:
    def __init__(self) -> None:
        self.processes = jax.process_count()
        self.multi = self.processes > 1
        self.leader = jax.process_index() == 0

    def ints(self, values: list[int]) -> list[int]:
        """The leader's integers (any size up to int64; followers pass a list of the same
        length, values ignored). Sent as pairs of int32 words: without `jax_enable_x64` a
        broadcast would truncate an int64 (a token count passes 2**31 in a long run)."""
        if not self.multi:
            return list(values)
        from jax.experimental import multihost_utils

        words = np.asarray(values, dtype=np.int64).view(np.int32)
        words = np.asarray(multihost_utils.broadcast_one_to_all(words), dtype=np.int32)
        return [int(v) for v in words.view(np.int64)]

    def arrays(self, tree: Any) -> Any:
        """The leader's pytree of numpy arrays; followers pass one of the same structure,
        shapes and dtypes (zeros), whose values are ignored."""
        if not self.multi:
            return tree
        from jax.experimental import multihost_utils

        return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))
