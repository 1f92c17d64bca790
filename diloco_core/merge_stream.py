"""The merge of one fragment, streamed tensor by tensor across the admitted contributions.

Holding every member's decoded outer gradient at once costs M fp32 fragments, and the whole
merged gradient, update and momentum a few more: ~25x one fragment at M = 8 (issue 37). Here a
merge makes two passes over the tensors and keeps only what it publishes:

  1. `gradient_stats`, per contribution: decode one tensor, check it is finite, reduce it to its
     share of the whole-fragment norm, drop it. Screening and weights need only these norms and
     the counters (diloco_core/syncer.py).
  2. `merge_streamed`, per tensor: decode that tensor from every kept member, combine it (RDA,
     weighted mean, or RDA per expert, with `merge.py`'s own functions), take the outer step on
     it with its slice of the outer state (`outer.slice_outer_state`), and keep only the new
     tensor and its new momentum.

Peak extra memory: the new fragment and its new outer state (what the merge publishes), plus M
decoded copies of the largest tensor. Each contribution is decoded twice (once per pass); int4
decodes at memory speed, so that is cheaper than keeping M decoded fragments.

The merged values are bit for bit those of `merge.merge_outer_grads` and `outer.outer_step`:
the same jitted RDA/mean on the same float32 values (XLA computes a tensor's reductions alike
inside one program per fragment or one per tensor; tests/test_merge_stream.py checks), and the
outer step runs op by op per tensor as it did per fragment. The whole-fragment norms are combined
from per-tensor partial sums (float64 on the host) instead of one float32 program, so they may
differ from `merge.tree_norm` in the last bits; the mean pairwise cosine (a diagnostic) comes from
a float32 Gram matrix per tensor summed in float64, not from float64 copies of every gradient.

Where the time goes (benchmarks/merge_cost.py): not memory traffic but XLA's CPU code for the
decode and for RDA's passes over the [M, N] stack of a tensor (norms, units, their weighted
sum), tens of times slower per value than a copy.

Programs are jitted per tensor and cached by shape (and by member count), so a fragment of many
tensors of a few shapes compiles a few small programs, not one per tensor.
"""

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_core.compression import _BITS, Encoded, _dequantize, decode
from diloco_core.merge import radial_directional_average, weighted_mean
from diloco_core.moe import is_expert_stack
from diloco_core.outer import join_outer_states, outer_step, slice_outer_state

FlatParams = dict[str, jax.Array]

# JAX dispatches asynchronously: unchecked, the loop over tensors would queue every tensor's
# program, each holding its inputs and outputs, and the peak would be the whole fragment's
# again. The loop waits for the queued tensors once they could hold this much.
_QUEUED_BYTES = 64 << 20


@dataclass(frozen=True)
class GradSource:
    """One member's outer gradient, described and not yet decoded: g = delta, or with the
    "global" anchor and an older base version g = (Theta_current - Theta_base) + delta."""

    delta: Mapping[str, Encoded]
    base: Mapping[str, jax.Array] | None = None


def _decode_traced(payload: jax.Array, scales: jax.Array | None, encoding: str,
                   block_size: int, shape: tuple[int, ...]) -> jax.Array:
    """`compression.decode` inside a program (the wire form was checked before)."""
    if encoding in _BITS:
        return _dequantize(payload, scales, _BITS[encoding], block_size,
                           math.prod(shape)).reshape(shape)
    return payload.astype(jnp.float32).reshape(shape)


def _peak_and_scaled_square_sum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """max|x| and sum((x / max|x|)^2): a tensor's share of a whole-fragment L2 norm, scaled as
    `merge._norm` is so that a huge finite value does not overflow to Inf."""
    peak = jnp.max(jnp.abs(x))
    scale = jnp.where(peak > 0, peak, 1.0)
    return peak, jnp.sum(jnp.square(x / scale))


@functools.partial(jax.jit, static_argnames=("encoding", "block_size", "shape"))
def _tensor_stats(payload, scales, current, base, encoding, block_size, shape):
    delta = _decode_traced(payload, scales, encoding, block_size, shape)
    grad = delta if base is None else (current - base) + delta
    return (jnp.all(jnp.isfinite(delta)),) + _peak_and_scaled_square_sum(grad)


@jax.jit
def _difference_stats(new: jax.Array, old: jax.Array):
    return _peak_and_scaled_square_sum(new - old)


def fragment_norm(parts: Sequence[tuple[float, float]]) -> float:
    """The L2 norm of a fragment from its tensors' (peak, scaled square sum) pairs."""
    peak = max((float(p) for p, _ in parts), default=0.0)
    if not peak > 0:
        return 0.0 if peak == 0 else float("nan")
    total = sum(float(s) * (float(p) / peak) ** 2 for p, s in parts)
    return float(peak * math.sqrt(total))


def gradient_stats(params: Mapping[str, jax.Array], source: GradSource,
                   names: Sequence[str]) -> tuple[bool, float]:
    """Pass 1 for one contribution: whether its decoded delta is finite everywhere, and the L2
    norm of its outer gradient over the whole fragment. One tensor decoded at a time."""
    results = []
    for name in names:
        e = source.delta[name]
        base = None if source.base is None else source.base[name]
        results.append(_tensor_stats(e.payload, e.scales, None if base is None else params[name],
                                     base, e.encoding, e.block_size, tuple(e.shape)))
    results = jax.device_get(results)    # one wait for the whole contribution
    finite = all(bool(f) for f, _, _ in results)
    return finite, fragment_norm([(p, s) for _, p, s in results]) if finite else float("nan")


@functools.partial(jax.jit, static_argnames=("encoding", "block_size", "shape"))
def _decoded_stack(payloads, scales, encoding, block_size, shape):
    """[M, *shape] float32: one tensor decoded from every member's wire form, written once.
    (Decoding inside the combining program instead is slower: XLA re-decodes in each of its
    passes over the members.)"""
    return jnp.stack([_decode_traced(p, s, encoding, block_size, shape)
                      for p, s in zip(payloads, scales, strict=True)])


@functools.partial(jax.jit, static_argnames=("kind",))
def _combine(stack: jax.Array, weights: jax.Array, kind: str):
    """`merge.merge_outer_grads` for one tensor, and the merged tensor's share of its norm."""
    if kind == "mean":
        merged = weighted_mean(stack, weights)
    elif kind == "expert":   # [M, E, ...]: RDA over the learners, per expert
        merged = jax.vmap(radial_directional_average, in_axes=(1, None))(stack, weights)
    else:
        merged = radial_directional_average(stack, weights)
    return (merged,) + _peak_and_scaled_square_sum(merged)


def _tensor_grad(params: Mapping[str, jax.Array], source: GradSource, name: str) -> jax.Array:
    delta = decode(source.delta[name])
    if source.base is None:
        return delta
    return (params[name] - source.base[name]) + delta


@dataclass(frozen=True)
class StreamedMerge:
    params: FlatParams               # the new fragment
    outer_state: optax.OptState      # its outer state (unchanged when averaging)
    merged_norm: float               # |merged outer gradient|
    update_norm: float               # |new - old|
    mean_cosine: float | None        # mean pairwise cosine of the members' outer gradients


def _mean_cosine(gram: np.ndarray) -> float | None:
    m = gram.shape[0]
    if m < 2:
        return None
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    denom = np.outer(norms, norms)
    cos = np.divide(gram, denom, out=np.zeros_like(gram), where=denom > 0)
    return float((cos.sum() - np.trace(cos)) / (m * (m - 1)))


def merge_streamed(params: Mapping[str, jax.Array], outer_state: optax.OptState,
                   sources: Sequence[GradSource], weights: np.ndarray, rule: str,
                   is_embedding: Callable[[str], bool], tx: optax.GradientTransformation,
                   average: bool = False) -> StreamedMerge:
    """Pass 2: merge the kept members' outer gradients tensor by tensor and step each tensor.

    `average` (a final round under `outer.final_rounds = "average"`): new = Theta - merged, the
    weighted average of the members' fragments, and the outer state stays as it is.
    """
    if not sources:
        raise ValueError("nothing to merge: no outer gradients")
    if len(sources) != len(weights):
        raise ValueError(f"{len(sources)} outer gradients but {len(weights)} weights")
    if rule not in ("rda", "mean"):
        raise ValueError(f"unknown merge rule {rule!r}")
    names = tuple(params)
    name_set = frozenset(names)
    for s in sources:
        if set(s.delta) != name_set:
            raise ValueError("outer gradients cover different tensors")
    w = jnp.asarray(weights, jnp.float32)
    stale = any(s.base is not None for s in sources)
    gram_wanted = len(sources) > 1
    new_params, new_slices, merged_parts, update_parts = {}, {}, [], []
    gram = np.zeros((len(sources), len(sources)))
    queued, queued_bytes = [], 0
    for name in names:
        kind = ("mean" if rule == "mean" or is_embedding(name)
                else "expert" if is_expert_stack(name) else "rda")
        if stale:   # the anchor's correction op by op, as the fragment-wide merge made it
            stack = jnp.stack([_tensor_grad(params, s, name).astype(jnp.float32)
                               for s in sources])
        else:
            first = sources[0].delta[name]
            stack = _decoded_stack(tuple(s.delta[name].payload for s in sources),
                                   tuple(s.delta[name].scales for s in sources),
                                   first.encoding, first.block_size, tuple(first.shape))
        merged, peak, square_sum = _combine(stack, w, kind)
        merged_parts.append((peak, square_sum))
        if gram_wanted:   # float32 BLAS on the host: XLA's [M, N] x [N, M] is slower here
            flat = np.asarray(stack).reshape(len(sources), -1)
            gram += (flat @ flat.T).astype(np.float64)
        del stack
        if average:
            new_params[name] = params[name] - merged
        else:
            stepped, new_slices[name] = outer_step(
                tx, {name: params[name]}, slice_outer_state(outer_state, name_set, name),
                {name: merged})
            new_params[name] = stepped[name]
        update_parts.append(_difference_stats(new_params[name], params[name]))
        del merged
        # The tensor's working set: M decoded copies, the merged tensor, the step's temporaries.
        queued.append((new_params[name], new_slices.get(name)))
        queued_bytes += 4 * math.prod(params[name].shape) * (len(sources) + 4)
        if queued_bytes > _QUEUED_BYTES:
            jax.block_until_ready(queued)
            queued, queued_bytes = [], 0
    new_state = (outer_state if average
                 else join_outer_states(outer_state, name_set, new_slices))
    # One wait at the end: the tensors' programs are dispatched without waiting on the host.
    merged_parts, update_parts = jax.device_get((merged_parts, update_parts))
    # The fragment-wide step returned its tensors in sorted order (a pytree map); keep that.
    order = names if average else sorted(names)
    return StreamedMerge({k: new_params[k] for k in order}, new_state,
                         fragment_norm(merged_parts), fragment_norm(update_parts),
                         _mean_cosine(gram) if gram_wanted else None)
