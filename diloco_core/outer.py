"""The syncer's outer optimizer: SGD with Nesterov momentum, one state per fragment.

The outer gradient is Delta = Theta - theta (previous global minus learner), the sign optax
expects, so `optax.sgd(lr, momentum, nesterov=True)` moves Theta towards the learners:
b <- mu*b + Delta; Theta <- Theta - lr*(Delta + mu*b). With lr=1 and mu=0, Theta becomes the
(weighted) learner average. Each fragment keeps its own momentum and steps only when it merges;
one optimizer over the whole tree would decay every fragment's momentum at every merge.

With `momentum_warmup_steps = W` the momentum of a fragment's n-th outer step (n from 0) is
mu * min(n / W, 1), injected by `optax.inject_hyperparams`, whose step count lives in the
fragment's own optimizer state (so it survives a syncer restart with the rest of the state).
With `lr_schedule = "inner"` the learning rate is a cosine of the same step count, over the
outer steps a fragment takes in the run (`outer_optimizer_for` reads them from the config).
"""

from collections.abc import Mapping

import jax
import optax

from diloco_core.config import ExperimentConfig, OuterOptConfig

FlatParams = dict[str, jax.Array]


def build_outer_optimizer(cfg: OuterOptConfig, horizon_steps: int = 1,
                          min_lr_ratio: float = 0.1) -> optax.GradientTransformation:
    """The outer optimizer of one fragment; `horizon_steps` and `min_lr_ratio` shape the
    learning rate under `lr_schedule = "inner"` (see `outer_optimizer_for`)."""
    nesterov = cfg.nesterov and cfg.momentum > 0
    lr = (optax.cosine_decay_schedule(cfg.lr, max(1, horizon_steps), alpha=min_lr_ratio)
          if cfg.lr_schedule == "inner" else cfg.lr)
    if cfg.momentum_warmup_steps == 0 or cfg.momentum == 0:
        return optax.sgd(learning_rate=lr, momentum=cfg.momentum or None, nesterov=nesterov)
    momentum = optax.linear_schedule(0.0, cfg.momentum, cfg.momentum_warmup_steps)
    return optax.inject_hyperparams(optax.sgd, static_args=("nesterov",))(
        learning_rate=lr, momentum=momentum, nesterov=nesterov)


def outer_optimizer_for(cfg: ExperimentConfig) -> optax.GradientTransformation:
    """The experiment's outer optimizer: its schedule spans the run's outer steps per fragment
    and ends at the inner schedule's floor."""
    return build_outer_optimizer(cfg.outer, cfg.outer_steps_per_fragment, cfg.inner.min_lr_ratio)


def outer_step(tx: optax.GradientTransformation, global_fragment: Mapping[str, jax.Array],
               opt_state: optax.OptState, outer_grad: Mapping[str, jax.Array]
               ) -> tuple[FlatParams, optax.OptState]:
    """One outer step on one fragment: returns the new global fragment and its optimizer state."""
    params = dict(global_fragment)
    updates, new_state = tx.update(dict(outer_grad), opt_state, params)
    return optax.apply_updates(params, updates), new_state
