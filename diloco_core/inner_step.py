"""The learner's inner step: one jitted AdamW update on a batch of the task (`objectives.py`)."""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import optax

from diloco_core.config import InnerOptConfig
from diloco_core.inner_optimizer import build_inner_optimizer, build_schedule
from diloco_core.model import FlatParams, ModelDef
from diloco_core.objectives import Batch, batch_tokens, training_loss


class TrainState(flax.struct.PyTreeNode):
    """A learner's device-side state.

    `tokens` is an int32 scalar counting tokens (B * L per step): exact up to 2**31 - 1 ~ 2.1e9
    tokens per learner, enough for any budget this project runs (float32 would stop counting
    exactly at 2**24 ~ 1.7e7, and int64 needs jax_enable_x64). A learner that could pass 2e9
    tokens must keep its own Python-int counter from `InnerStep.tokens_per_batch`.
    """

    params: FlatParams
    opt_state: optax.OptState
    step: jax.Array    # int32 scalar: inner steps taken
    tokens: jax.Array  # int32 scalar: tokens processed


class InnerStep:
    """Builds the optimizer and the jitted `step` once; `step` donates params and opt_state."""

    def __init__(self, model_def: ModelDef, inner_cfg: InnerOptConfig, total_steps: int):
        self.model_def = model_def
        self.optimizer, self.schedule, self._step = _compiled_update(model_def, inner_cfg,
                                                                     total_steps)

    def init(self, params: FlatParams) -> TrainState:
        # Copy: `step` donates the state's buffers, which must not alias the caller's params.
        params = jax.tree.map(jnp.copy, params)
        return TrainState(params=params, opt_state=self.optimizer.init(params),
                          step=jnp.zeros((), jnp.int32), tokens=jnp.zeros((), jnp.int32))

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One update on a batch (int32 [B, L] of text, or images and labels). `state`'s params
        and opt_state are donated: use only the returned state.

        Metrics ("loss" = cross-entropy, "aux_loss" of MoE routing, "grad_norm" before clipping,
        "lr" used for this step; "accuracy" for images) stay on device so the caller decides
        when to sync.
        """
        params, opt_state, step, tokens, metrics = self._step(
            state.params, state.opt_state, state.step, state.tokens, batch)
        return TrainState(params=params, opt_state=opt_state, step=step, tokens=tokens), metrics

    @staticmethod
    def tokens_per_batch(batch: Batch) -> int:
        """Tokens a step on `batch` processes (B * L, or B images), as in `TrainState.tokens`."""
        return batch_tokens(batch)


@functools.lru_cache(maxsize=16)
def _compiled_update(model_def: ModelDef, inner_cfg: InnerOptConfig, total_steps: int):
    """Optimizer, schedule and jitted update, shared by every InnerStep of the same setup.

    Cached so that the M learners of a run, and the runs of a sweep, compile the step once.
    Params and optimizer state are donated (updated in place, no second copy in memory); the
    step/token scalars are not, so a state that shares them with another (e.g. a rejoining
    learner adopting a peer's step count) cannot delete the other's.
    """
    optimizer = build_inner_optimizer(inner_cfg, total_steps)
    schedule = build_schedule(inner_cfg, total_steps)

    def update(params: FlatParams, opt_state: optax.OptState, step: jax.Array,
               tokens: jax.Array, batch: Batch):
        (_, metrics), grads = jax.value_and_grad(training_loss, argnums=1, has_aux=True)(
            model_def, params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads),
                   "lr": jnp.asarray(schedule(step), jnp.float32)}
        return (optax.apply_updates(params, updates), opt_state, step + 1,
                tokens + batch_tokens(batch), metrics)

    return optimizer, schedule, jax.jit(update, donate_argnums=(0, 1))
