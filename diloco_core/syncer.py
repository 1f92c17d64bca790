"""The syncer's state and the merge of one round, as pure transitions.

The syncer owns the global parameters Theta, one per fragment with a version number, and one
outer-optimizer state per fragment. A merge validates each admitted contribution, turns it into
an outer gradient, weights the learners by tokens^2/steps, combines them (RDA or mean), takes one
outer Nesterov step on that fragment only, and records what it did and why.

Outer gradient anchor ("global", the paper's Appendix D.2): g = Theta_current - theta_m, which a
learner whose base version is older rebuilds as (Theta_current - Theta_base) + delta_m; the
syncer keeps recent versions for that. With anchor "base", g = delta_m (the learner's own
progress only).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import optax

from diloco_core.compression import decode
from diloco_core.config import SyncConfig
from diloco_core.contribution import Contribution
from diloco_core.fragments import FragmentPlan
from diloco_core.merge import merge_outer_grads, tree_norm
from diloco_core.outer import outer_step
from diloco_core.weights import normalized_weights

FlatParams = dict[str, jax.Array]


@dataclass(frozen=True)
class SyncerState:
    fragments: tuple[FlatParams, ...]                 # current Theta_p
    versions: tuple[int, ...]
    outer_states: tuple[optax.OptState, ...]
    history: tuple[dict[int, FlatParams], ...]        # recent versions of each fragment
    history_size: int = 32

    @classmethod
    def start(cls, fragments: Sequence[FlatParams], tx: optax.GradientTransformation,
              history_size: int = 32) -> "SyncerState":
        frags = tuple(dict(f) for f in fragments)
        return cls(frags, (0,) * len(frags), tuple(tx.init(f) for f in frags),
                   tuple({0: f} for f in frags), history_size)


@dataclass(frozen=True)
class MergeRecord:
    """The decision record of one round: who was merged with what weight, who was not, and why."""

    round: int
    fragment: int
    merged: bool
    version: int                                       # version after this round
    reason: str
    members: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    rejected: dict[str, str] = field(default_factory=dict)
    late: tuple[str, ...] = ()
    outer_grad_norms: tuple[float, ...] = ()
    merged_norm: float = 0.0
    update_norm: float = 0.0
    bytes_in: int = 0


def _validate(state: SyncerState, plan: FragmentPlan, c: Contribution) -> str | None:
    """Why a contribution cannot be merged, or None if it can."""
    if not 0 <= c.fragment < plan.num_fragments:
        return f"fragment {c.fragment} does not exist (P={plan.num_fragments})"
    if set(c.delta) != set(plan.fragments[c.fragment]):
        return "tensor names do not match the fragment"
    current = state.fragments[c.fragment]
    for name, enc in c.delta.items():
        if tuple(enc.shape) != tuple(current[name].shape):
            return f"tensor {name} has shape {tuple(enc.shape)}, expected {current[name].shape}"
    if c.steps < 1 or c.tokens < 1:
        return f"no progress to merge (steps={c.steps}, tokens={c.tokens})"
    if c.base_version > state.versions[c.fragment]:
        return (f"base version {c.base_version} is newer than the syncer's "
                f"{state.versions[c.fragment]}")
    return None


@jax.jit
def _all_finite_device(tree: FlatParams) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in tree.values()]))


def _all_finite(tree: FlatParams) -> bool:
    return bool(_all_finite_device(tree))


def _outer_grad(state: SyncerState, c: Contribution, anchor: str) -> FlatParams | str:
    delta = {name: decode(enc) for name, enc in c.delta.items()}
    if not _all_finite(delta):
        return "outer gradient contains NaN or Inf"
    if anchor == "base" or c.base_version == state.versions[c.fragment]:
        return delta
    base = state.history[c.fragment].get(c.base_version)
    if base is None:
        return (f"base version {c.base_version} is older than the {state.history_size} versions "
                "the syncer keeps")
    current = state.fragments[c.fragment]
    return {name: (current[name] - base[name]) + delta[name] for name in delta}


def merge_round(state: SyncerState, plan: FragmentPlan, round_index: int, fragment: int,
                contributions: Sequence[Contribution], cfg: SyncConfig,
                tx: optax.GradientTransformation, is_embedding: Callable[[str], bool],
                reason: str, late: Sequence[str] = ()) -> tuple[SyncerState, MergeRecord]:
    """Merge the admitted contributions of one round into fragment `fragment`."""
    rejected: dict[str, str] = {}
    accepted: list[tuple[Contribution, FlatParams]] = []
    for c in contributions:
        why = _validate(state, plan, c) if c.fragment == fragment else (
            f"offered fragment {c.fragment} to a round of fragment {fragment}")
        grad = why if why is not None else _outer_grad(state, c, cfg.anchor)
        if isinstance(grad, str):
            rejected[c.learner] = grad
        else:
            accepted.append((c, grad))
    bytes_in = sum(c.nbytes for c in contributions)
    if not accepted:
        return state, MergeRecord(round_index, fragment, False, state.versions[fragment],
                                  f"{reason}; nothing merged: every contribution was rejected",
                                  rejected=rejected, late=tuple(late), bytes_in=bytes_in)

    members = [c for c, _ in accepted]
    grads = [g for _, g in accepted]
    weights = normalized_weights([c.tokens for c in members], [c.steps for c in members],
                                 cfg.weighting)
    merged = merge_outer_grads(grads, weights, cfg.merge_rule, is_embedding)
    new_fragment, new_opt = outer_step(tx, state.fragments[fragment],
                                       state.outer_states[fragment], merged)
    version = state.versions[fragment] + 1
    update = {k: new_fragment[k] - state.fragments[fragment][k] for k in new_fragment}

    history = dict(state.history[fragment])
    history[version] = new_fragment
    for old in sorted(history)[:-state.history_size]:
        del history[old]

    def put(seq, value):
        items = list(seq)
        items[fragment] = value
        return tuple(items)

    new_state = replace(state, fragments=put(state.fragments, new_fragment),
                        versions=put(state.versions, version),
                        outer_states=put(state.outer_states, new_opt),
                        history=put(state.history, history))
    record = MergeRecord(
        round_index, fragment, True, version, reason,
        members=tuple(c.learner for c in members),
        weights=tuple(float(w) for w in weights),
        tokens=tuple(c.tokens for c in members), steps=tuple(c.steps for c in members),
        rejected=rejected, late=tuple(late),
        outer_grad_norms=tuple(tree_norm(g) for g in grads),
        merged_norm=tree_norm(merged), update_norm=tree_norm(update), bytes_in=bytes_in)
    return new_state, record
