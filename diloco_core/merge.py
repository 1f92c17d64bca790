"""Combining the admitted learners' outer gradients of one fragment into one.

Per tensor: embedding tensors take the weighted mean; every other tensor takes weighted
radial-directional averaging (RDA) when `rule == "rda"`:

    RDA({g_m, w_m}) = (sum_m w_m |g_m|) * phi(sum_m w_m phi(g_m)),   phi(x) = x/|x|, phi(0) = 0

with weights summing to 1. Learners' outer gradients are nearly orthogonal, so their plain mean
shrinks like 1/sqrt(M); RDA keeps the weighted mean norm and only averages directions, so the
outer learning rate does not need re-tuning when the number of merged learners changes. Embedding
outer gradients are not near-orthogonal (rows of rare tokens), hence the plain mean there.

Mixture-of-experts expert stacks [E, ...] take RDA expert by expert: each expert is its own MLP,
and how far a learner moved it depends on how many of its tokens were routed there, so one
expert's norm must not set the radius or swamp the direction of another's. (The router is an
ordinary tensor.)
"""

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diloco_core.moe import is_expert_stack

FlatParams = dict[str, jax.Array]


def _norm(x: jax.Array) -> jax.Array:
    """L2 norm scaled by the largest magnitude first: the plain sum of squares overflows
    float32 above ~1.8e19, and a finite outer gradient that large (a diverging learner, to be
    screened out) must not turn the merge into NaN."""
    peak = jnp.max(jnp.abs(x))
    scale = jnp.where(peak > 0, peak, 1.0)
    return scale * jnp.linalg.norm(x / scale)


def _unit(x: jax.Array) -> jax.Array:
    norm = _norm(x)
    return jnp.where(norm > 0, x / jnp.where(norm > 0, norm, 1.0), jnp.zeros_like(x))


@jax.jit
def weighted_mean(stack: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_m w_m g_m over the leading axis."""
    return jnp.tensordot(weights, stack, axes=1)


@jax.jit
def radial_directional_average(stack: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted RDA over the leading axis (see the module docstring)."""
    flat = stack.reshape(stack.shape[0], -1)
    norms = jax.vmap(_norm)(flat)
    radius = jnp.dot(weights, norms)
    # sum_m w_m phi(g_m) accumulated member by member (M is static: an unrolled sum that XLA
    # fuses into one pass), each member scaled by its weight over the norm computed above
    # (phi(0) = 0: a zero member adds nothing). A dot over the stacked unit vectors wrote an
    # [M, N] copy of them and computed every norm twice: 3-4x as long on CPU (issue 37's
    # merge profile, benchmarks/results/merge_profile.json).
    scales = jnp.where(norms > 0, weights / jnp.where(norms > 0, norms, 1.0), 0.0)
    total = scales[0] * flat[0]
    for m in range(1, flat.shape[0]):
        total = total + scales[m] * flat[m]
    return (radius * _unit(total)).reshape(stack.shape[1:])


def merge_outer_grads(grads: Sequence[Mapping[str, jax.Array]], weights: np.ndarray,
                      rule: str, is_embedding: Callable[[str], bool]) -> FlatParams:
    """Merge one fragment's outer gradients from several learners, tensor by tensor."""
    if not grads:
        raise ValueError("nothing to merge: no outer gradients")
    if len(grads) != len(weights):
        raise ValueError(f"{len(grads)} outer gradients but {len(weights)} weights")
    if rule not in ("rda", "mean"):
        raise ValueError(f"unknown merge rule {rule!r}")
    names = sorted(grads[0])
    for g in grads[1:]:
        if sorted(g) != names:
            raise ValueError("outer gradients cover different tensors")
    mean_names = frozenset(n for n in names if rule == "mean" or is_embedding(n))
    expert_names = frozenset(n for n in names if is_expert_stack(n))
    return _merge_fragment(tuple(dict(g) for g in grads), jnp.asarray(weights, jnp.float32),
                           mean_names, expert_names)


@functools.partial(jax.jit, static_argnames=("mean_names", "expert_names"))
def _merge_fragment(grads: tuple[FlatParams, ...], weights: jax.Array,
                    mean_names: frozenset[str], expert_names: frozenset[str]) -> FlatParams:
    # One compiled program per (fragment layout, number of learners), not one per tensor.
    merged = {}
    for name in grads[0]:
        stack = jnp.stack([g[name].astype(jnp.float32) for g in grads])
        if name in mean_names:
            merged[name] = weighted_mean(stack, weights)
        elif name in expert_names:   # [M, E, ...]: RDA over the learners, per expert
            merged[name] = jax.vmap(radial_directional_average, in_axes=(1, None))(stack,
                                                                                  weights)
        else:
            merged[name] = radial_directional_average(stack, weights)
    return merged


@jax.jit
def _tree_norm(tree: FlatParams) -> jax.Array:
    values = [v.astype(jnp.float32) for v in tree.values()]
    peak = jnp.max(jnp.stack([jnp.max(jnp.abs(v)) for v in values]))
    scale = jnp.where(peak > 0, peak, 1.0)      # as in `_norm`: no overflow for huge values
    return scale * jnp.sqrt(sum(jnp.sum(jnp.square(v / scale)) for v in values))


def tree_norm(tree: Mapping[str, jax.Array]) -> float:
    """Global L2 norm of a flat dict of arrays."""
    return float(_tree_norm(dict(tree)))


def pairwise_cosines(grads: Sequence[Mapping[str, jax.Array]]) -> np.ndarray:
    """M x M cosine similarities of whole-fragment outer gradients (diagnostics)."""
    vecs = jnp.stack([jnp.concatenate([jnp.ravel(g[n]) for n in sorted(g)]) for g in grads])
    units = jax.vmap(_unit)(vecs)
    return np.asarray(units @ units.T)


def mean_pairwise_cosine(grads: Sequence[Mapping[str, jax.Array]]) -> float | None:
    """The mean of the off-diagonal pairwise cosines; None with fewer than two gradients.

    A diagnostic, computed on the host in NumPy: it must not add an XLA compilation (one per
    fragment layout and member count) to every merge run, where latency matters.
    """
    m = len(grads)
    if m < 2:
        return None
    gram = np.zeros((m, m))
    for name in grads[0]:
        flat = np.stack([np.asarray(g[name], dtype=np.float32).ravel() for g in grads])
        gram += flat.astype(np.float64) @ flat.T.astype(np.float64)
    norms = np.sqrt(np.diag(gram))
    denom = np.outer(norms, norms)
    cos = np.divide(gram, denom, out=np.zeros_like(gram), where=denom > 0)
    return float((cos.sum() - np.trace(cos)) / (m * (m - 1)))
