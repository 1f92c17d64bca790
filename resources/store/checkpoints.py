"""Learner checkpoints through an Orbax `CheckpointManager`, on a local path or `gs://`.

A checkpoint is two Orbax items under one step directory:
- "state": the array pytree (params, AdamW state, step and token counters, the learner's RNG key
  data, and the per-fragment anchors it last received), restored into an abstract target so
  optax states come back with their own types;
- "meta": plain JSON (data-iterator position, sync counters and versions, the learner's name).

A save either blocks until durable (`wait=True`: a learner killed right after `save` returns
still has that checkpoint) or returns once Orbax has taken the (host) arrays and writes them
in the background (`wait=False`), so a learner trains on while a checkpoint of a
large model takes minutes to reach GCS. `durable_step` is the newest step known to be written
(`poll` looks without blocking, `wait` blocks); only that step is ever reported as a
checkpoint. A background write that failed raises at the next `poll`, `wait` or `save`.

On GCS, Orbax writes through TensorStore, which a loopback test server reaches through
`TENSORSTORE_GCS_HTTP_URL` (see tests/gcs_emulator.py).

`use_ocdbt` (Orbax's default, on) packs arrays into an OCDBT database whose manifest TensorStore
writes conditionally on object generations (the loopback test server is taught to send them,
see tests/gcs_emulator.py).
"""

from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_target(tree: Any) -> Any:
    """The shape/dtype skeleton of a pytree, to restore into."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class LearnerCheckpoints:
    """One learner's checkpoints: save, list, restore (into an abstract target), keep the last N."""

    def __init__(self, directory: str, max_to_keep: int = 3, use_ocdbt: bool = True,
                 read_only: bool = False, *, directories_in_background: bool = False):
        """`read_only` for reading another learner's checkpoints while it may be saving: the
        manager then never creates, cleans up or deletes anything there.
        `directories_in_background`: Orbax's default, unsafe with two managers saving in one
        process (see below); only `benchmarks/checkpoint_save.py` sets it, to measure what
        creating them on the caller's thread costs."""
        self.directory = directory
        # Directories created before the save returns, not in Orbax's background: Orbax
        # numbers save operations process-wide, so with two managers saving at once in one
        # process (learner runtimes as threads) one manager's item was written before its
        # directory existed, or a save waited forever on a signal meant for the other
        # (tests/test_checkpoints.py::test_two_learners_in_one_process_save_side_by_side).
        # The cost is a few directory creations on the caller's thread per save.
        options = (ocp.CheckpointManagerOptions(read_only=True, create=False) if read_only else
                   ocp.CheckpointManagerOptions(
                       max_to_keep=max_to_keep, create=True,
                       async_options=ocp.AsyncOptions(
                           create_directories_asynchronously=directories_in_background)))
        self.manager = ocp.CheckpointManager(
            directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt),
                           "meta": ocp.JsonCheckpointHandler()})
        self._pending: int | None = None            # a step whose background write may run
        self.durable_step: int | None = None        # the newest step this object saw written

    def save(self, step: int, state: Any, meta: dict, wait: bool = True) -> None:
        """Save `step`, replacing a checkpoint of the same step (e.g. one saved before the sync
        state moved on without a step: an offer or a received fragment). A previous background
        save is finished first (Orbax writes one at a time).

        `wait=False` takes host arrays (`jax.device_get`): the learner's jitted step donates
        its state's buffers, and the background write must read values that step cannot
        reuse (a copy off an accelerator; on CPU a view whose reference keeps XLA from
        reusing that buffer; `tests/test_checkpoints.py` steps on while the write runs)."""
        if self._pending is not None:
            self.wait()
        if step in self.manager.all_steps():
            self.manager.delete(step)
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self._pending = step
        if wait:
            self.wait()

    def poll(self) -> int | None:
        """The newest durable step, without blocking on a save in flight."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self._settle()
        return self.durable_step

    def wait(self) -> int | None:
        """Block until the save in flight (if any) is durable; the newest durable step."""
        if self._pending is not None:
            self.manager.wait_until_finished()
            self._settle()
        return self.durable_step

    def _settle(self) -> None:
        step, self._pending = self._pending, None
        self.manager.check_for_errors()   # a failed background write raises here
        self.durable_step = step

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore(self, step: int | None = None, target: Any = None) -> tuple[Any, dict]:
        """(state, meta) of `step` (default: the latest). Pass `abstract_target(template)` to
        get optax states back as their NamedTuples; without it, plain containers."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint at step {step} in {self.directory} "
                                    f"(have {self.all_steps()})")
        state_args = ocp.args.StandardRestore(target) if target is not None \
            else ocp.args.StandardRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=state_args, meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def gc(self, keep_last: int) -> list[int]:
        """Explicitly delete all but the last `keep_last` checkpoints; returns the steps removed."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        doomed = self.all_steps()[:-keep_last]
        for step in doomed:
            self.manager.delete(step)
        return doomed

    def close(self) -> None:
        """Finish the save in flight, then release the manager."""
        try:
            self.wait()
        finally:
            self.manager.close()
