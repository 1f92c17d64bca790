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

from collections.abc import Callable, Mapping, Sequence

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


# ---- a group of tensors at a time ------------------------------------------------------------
# The streaming merge (diloco_core/merge_stream.py) steps a fragment group by group (consecutive
# tensors up to a byte budget) so that it never holds a whole merged outer gradient, its update
# and the new momentum at once. That is exact for the optimizers built here: SGD, momentum,
# Nesterov, their schedules and inject_hyperparams are all elementwise per leaf, so a leaf's new
# value depends only on that leaf, its own slice of the state and the state's shared scalars
# (step counts, injected hyperparameters), which every group's step computes alike. The state's
# per-tensor parts are the dicts keyed by exactly the fragment's tensor names (what
# `tx.init(fragment)` builds).
#
# A group is stepped as one flat vector, the concatenation of its tensors (key `PACKED`): the
# step's elementwise ops, run one by one as before, give every value the same bits as per
# tensor, in one dispatch per op for the group instead of one per op per tensor.

PACKED = "packed"


def _per_tensor(names: frozenset[str]) -> Callable[[object], bool]:
    return lambda x: isinstance(x, dict) and x.keys() == names


def pack_outer_state(opt_state: optax.OptState, names: frozenset[str],
                     pack: Callable[[Mapping[str, jax.Array]], jax.Array]) -> optax.OptState:
    """`opt_state` as the state of the one-tensor fragment {PACKED}: every dict of the
    fragment's tensors replaced by {PACKED: pack(that dict)}, the shared leaves (counts,
    hyperparameters) as they are."""
    is_tensors = _per_tensor(names)
    return jax.tree.map(lambda x: {PACKED: pack(x)} if is_tensors(x) else x, opt_state,
                        is_leaf=is_tensors)


def unpack_outer_state(packed: optax.OptState,
                       unpack: Callable[[jax.Array], dict[str, jax.Array]]) -> optax.OptState:
    """The inverse of `pack_outer_state` for one group: every {PACKED: v} becomes unpack(v),
    the group's tensors by name."""
    is_packed = _per_tensor(frozenset((PACKED,)))
    return jax.tree.map(lambda x: unpack(x[PACKED]) if is_packed(x) else x, packed,
                        is_leaf=is_packed)


def join_outer_states(opt_state: optax.OptState, names: frozenset[str],
                      parts: Sequence[tuple[frozenset[str], optax.OptState]]) -> optax.OptState:
    """The fragment's state from its groups' stepped states (`(group, state)`, the groups
    covering `names`, each state's per-tensor dicts keyed by its group), in `opt_state`'s
    structure and key order; shared leaves from the first part (every group stepped them
    alike)."""
    leaves, treedef = jax.tree.flatten(opt_state, is_leaf=_per_tensor(names))
    by_name: dict[str, list] = {}
    first = None
    for group, state in parts:
        flat, tdef = jax.tree.flatten(state, is_leaf=_per_tensor(group))
        if tdef != treedef:
            raise ValueError(f"the outer state of tensors {sorted(group)} changed structure: "
                             f"{tdef}")
        first = flat if first is None else first
        by_name.update({name: flat for name in group})
    if first is None or by_name.keys() != names:
        raise ValueError("the groups' states do not cover the fragment's tensors")
    joined = [{k: by_name[k][i][k] for k in leaf} if _per_tensor(names)(leaf) else first[i]
              for i, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, joined)
