"""The syncer's outer optimizer: SGD with Nesterov momentum, one state per fragment.

The outer gradient is Delta = Theta - theta (previous global minus learner), the sign optax
expects, so `optax.sgd(lr, momentum, nesterov=True)` moves Theta towards the learners:
b <- mu*b + Delta; Theta <- Theta - lr*(Delta + mu*b). With lr=1 and mu=0, Theta becomes the
(weighted) learner average. Each fragment keeps its own momentum and steps only when it merges;
one optimizer over the whole tree would decay every fragment's momentum at every merge.

With `momentum_warmup_steps = W` the momentum of a fragment's n-th outer step (n from 0) is
mu * min(n / W, 1), injected by `optax.inject_hyperparams`, whose step count lives in the
fragment's own optimizer state (so it survives a syncer restart with the rest of the state).
"""

from collections.abc import Mapping

import jax
import optax

from diloco_core.config import OuterOptConfig

FlatParams = dict[str, jax.Array]


def build_outer_optimizer(cfg: OuterOptConfig) -> optax.GradientTransformation:
    nesterov = cfg.nesterov and cfg.momentum > 0
    if cfg.momentum_warmup_steps == 0 or cfg.momentum == 0:
        return optax.sgd(learning_rate=cfg.lr, momentum=cfg.momentum or None, nesterov=nesterov)
    momentum = optax.linear_schedule(0.0, cfg.momentum, cfg.momentum_warmup_steps)
    return optax.inject_hyperparams(optax.sgd, static_args=("nesterov",))(
        learning_rate=cfg.lr, momentum=momentum, nesterov=nesterov)


def outer_step(tx: optax.GradientTransformation, global_fragment: Mapping[str, jax.Array],
               opt_state: optax.OptState, outer_grad: Mapping[str, jax.Array]
               ) -> tuple[FlatParams, optax.OptState]:
    """One outer step on one fragment: returns the new global fragment and its optimizer state."""
    params = dict(global_fragment)
    updates, new_state = tx.update(dict(outer_grad), opt_state, params)
    return optax.apply_updates(params, updates), new_state
