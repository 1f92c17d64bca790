"""The merge of one fragment, streamed group by group across the admitted contributions.

Holding every member's decoded outer gradient at once costs M fp32 fragments, and the whole
merged gradient, update and momentum a few more: ~25x one fragment at M = 8 (issue 37). Here a
merge makes two passes over the fragment's tensors, in groups of consecutive tensors whose
working set stays under `_GROUP_BYTES` (a tensor larger than that is a group of its own), and
keeps only what it publishes:

  1. `gradient_stats`, per contribution: decode one group, check it is finite, reduce each
     tensor to its share of the whole-fragment norm, drop it. Screening and weights need only
     these norms and the counters (diloco_core/syncer.py).
  2. `merge_streamed`, per group: decode that group from every kept member, combine each tensor
     (RDA, weighted mean, or RDA per expert, with `merge.py`'s own functions), take the outer
     step on the group with its part of the outer state (`outer.pack_outer_state`), and keep
     only the new tensors and their new momentum.

Peak extra memory: the new fragment and its new outer state (what the merge publishes), plus
one group's working set (JAX dispatches asynchronously: before dispatching a group that would
take what is queued past the budget, the loop waits for it). Each contribution is decoded twice
(once per pass); int4 decodes at memory speed, so that is cheaper than keeping M decoded
fragments.

Why groups and not single tensors: a small fragment (the demo's: 13 tensors, 0.4M parameters)
costs its dispatches and its waits, not its arithmetic. Per tensor, the merge dispatched ~16
programs and waited on the host once; under four learners' load on two cores that made it 1.7x
the fragment-wide merge it replaced (benchmarks/merge_under_load.py). Per group it is one
program per contribution in pass 1, then one to decode, one to combine, a dozen elementwise ops
for the outer step with a few to pack the group's parameters and momentum into one vector and
back, and one for the update's norm; the host waits once per fragment (and per group whose
Gram matrices it computes, or whose dispatch would overrun the budget).

The merged values are bit for bit those of `merge.merge_outer_grads` and `outer.outer_step`:
the same RDA/mean on the same float32 values (XLA computes a tensor's reductions alike inside
one program per fragment or one per group; tests/test_merge_stream.py checks), and the outer
step runs op by op, as it did per fragment, on the group's tensors concatenated into one vector
(elementwise ops give each value the same bits; a jitted step would not: XLA fuses and contracts
its multiply-adds). The whole-fragment norms are combined from per-tensor partial sums (float64
on the host) instead of one float32 program, so they may differ from `merge.tree_norm` in the
last bits; the mean pairwise cosine (a diagnostic) comes from a float32 Gram matrix per tensor
summed in float64, not from float64 copies of every gradient.

Where the time goes on large fragments (benchmarks/merge_cost.py): not memory traffic but XLA's
CPU code for the decode and for RDA's passes over the [M, N] stack of a tensor (norms, units,
their weighted sum), tens of times slower per value than a copy.

Programs are jitted per group and cached by its tensors' shapes, encodings and kinds (and by
member count): the syncer's warm-up compiles each fragment's for every member count (pass 1
against an older base, under the "global" anchor, compiles on the first such offer).
"""

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_core.compression import _BITS, Encoded, _dequantize, decode
from diloco_core.merge import radial_directional_average, weighted_mean
from diloco_core.moe import is_expert_stack
from diloco_core.outer import (
    PACKED,
    join_outer_states,
    outer_step,
    pack_outer_state,
    unpack_outer_state,
)

FlatParams = dict[str, jax.Array]

# A group's working set (decoded copies, merged tensors, the step's temporaries) stays under
# this. JAX dispatches asynchronously: unchecked, the loop over groups would queue every group's
# programs, each holding its inputs and outputs, and the peak would be the whole fragment's
# again, so the loop also waits for the queued groups once they could hold this much.
_GROUP_BYTES = 64 << 20
# The cosine's Gram matrices: XLA's CPU dot is ~5x slower than the host's BLAS on a [8, 4M]
# stack (and on [4, 1M]) but needs no wait on the host, which costs more for a group of small
# tensors (on [4, 400k] XLA's is the faster). Groups of
# more values per member than this hand their stacks to the host.
_HOST_GRAM_VALUES = 1 << 19


@dataclass(frozen=True)
class GradSource:
    """One member's outer gradient, described and not yet decoded: g = delta, or with the
    "global" anchor and an older base version g = (Theta_current - Theta_base) + delta."""

    delta: Mapping[str, Encoded]
    base: Mapping[str, jax.Array] | None = None


class _Wire(NamedTuple):
    """How one tensor arrives (static in the programs: each combination compiles once)."""

    shape: tuple[int, ...]
    encoding: str
    block_size: int

    @classmethod
    def of(cls, e: Encoded) -> "_Wire":
        # A block size means something only to a quantized encoding, and the syncer checks it
        # only there: left in the key of a bf16 or fp32 wire, each value a learner sent would
        # compile the group's programs again.
        return cls(tuple(e.shape), e.encoding, e.block_size if e.encoding in _BITS else 0)


def _groups(names: Sequence[str], shapes: Mapping[str, tuple[int, ...]],
            bytes_per_value: int) -> list[tuple[str, ...]]:
    """Consecutive runs of `names` whose working set (`bytes_per_value` a parameter) stays
    under `_GROUP_BYTES`; a larger tensor is a group of its own."""
    groups, current, size = [], [], 0
    for name in names:
        cost = bytes_per_value * math.prod(shapes[name])
        if current and size + cost > _GROUP_BYTES:
            groups.append(tuple(current))
            current, size = [], 0
        current.append(name)
        size += cost
    return groups + [tuple(current)] if current else groups


def _decode_traced(payload: jax.Array, scales: jax.Array | None, wire: _Wire) -> jax.Array:
    """`compression.decode` inside a program (the wire form was checked before)."""
    if wire.encoding in _BITS:
        return _dequantize(payload, scales, _BITS[wire.encoding], wire.block_size,
                           math.prod(wire.shape)).reshape(wire.shape)
    return payload.astype(jnp.float32).reshape(wire.shape)


def _peak_and_scaled_square_sum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """max|x| and sum((x / max|x|)^2): a tensor's share of a whole-fragment L2 norm, scaled as
    `merge._norm` is so that a huge finite value does not overflow to Inf."""
    peak = jnp.max(jnp.abs(x))
    scale = jnp.where(peak > 0, peak, 1.0)
    return peak, jnp.sum(jnp.square(x / scale))


def _stacked_norm_parts(xs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    parts = [_peak_and_scaled_square_sum(x) for x in xs]
    return jnp.stack([p for p, _ in parts]), jnp.stack([s for _, s in parts])


@functools.partial(jax.jit, static_argnames=("wires",))
def _group_stats(payloads, scales, currents, bases, wires):
    """Pass 1 for one group of one contribution: per tensor, whether the decoded delta is
    finite, and the outer gradient's (peak, scaled square sum)."""
    deltas = [_decode_traced(p, s, w) for p, s, w in zip(payloads, scales, wires, strict=True)]
    grads = [d if b is None else (c - b) + d
             for d, c, b in zip(deltas, currents, bases, strict=True)]
    finite = jnp.stack([jnp.all(jnp.isfinite(d)) for d in deltas])
    return (finite,) + _stacked_norm_parts(grads)


@jax.jit
def _difference_stats(new: tuple[jax.Array, ...], old: tuple[jax.Array, ...]):
    return _stacked_norm_parts([n - o for n, o in zip(new, old, strict=True)])


def fragment_norm(parts: Sequence[tuple[float, float]]) -> float:
    """The L2 norm of a fragment from its tensors' (peak, scaled square sum) pairs."""
    peak = max((float(p) for p, _ in parts), default=0.0)
    if not peak > 0:
        return 0.0 if peak == 0 else float("nan")
    total = sum(float(s) * (float(p) / peak) ** 2 for p, s in parts)
    return float(peak * math.sqrt(total))


def _pairs(peaks: Sequence[np.ndarray], sums: Sequence[np.ndarray]) -> list[tuple[float, float]]:
    return list(zip(np.concatenate(peaks).tolist(), np.concatenate(sums).tolist(), strict=True))


def gradient_stats(params: Mapping[str, jax.Array], source: GradSource,
                   names: Sequence[str]) -> tuple[bool, float]:
    """Pass 1 for one contribution: whether its decoded delta is finite everywhere, and the L2
    norm of its outer gradient over the whole fragment. One group decoded at a time."""
    results = []
    shapes = {n: tuple(source.delta[n].shape) for n in names}
    for group in _groups(names, shapes, 4 * 3):
        encoded = [source.delta[n] for n in group]
        stale = source.base is not None
        results.append(_group_stats(
            tuple(e.payload for e in encoded), tuple(e.scales for e in encoded),
            tuple(params[n] if stale else None for n in group),
            tuple(source.base[n] if stale else None for n in group),
            tuple(_Wire.of(e) for e in encoded)))
    results = jax.device_get(results)    # one wait for the whole contribution
    if not all(bool(np.all(f)) for f, _, _ in results):
        return False, float("nan")
    return True, fragment_norm(_pairs([p for _, p, _ in results], [s for _, _, s in results]))


@functools.partial(jax.jit, static_argnames=("kinds", "gram"))
def _combine(stacks, weights, kinds, gram: str):
    """`merge.merge_outer_grads` for each tensor of a group (its [M, ...] stack): the merged
    tensors packed (`_packed`), their norm parts, and with `gram="program"` their [M, M] Gram
    matrices for the diagnostic cosine."""
    merged = []
    for stack, kind in zip(stacks, kinds, strict=True):
        if kind == "mean":
            merged.append(weighted_mean(stack, weights))
        elif kind == "expert":   # [M, E, ...]: RDA over the learners, per expert
            merged.append(jax.vmap(radial_directional_average, in_axes=(1, None))(stack, weights))
        else:
            merged.append(radial_directional_average(stack, weights))
    grams = None
    if gram == "program":
        # Contracting both operands' value axes: no transposed copy of the stack.
        grams = jnp.stack([jax.lax.dot_general(f, f, (((1,), (1,)), ((), ())),
                                               precision=jax.lax.Precision.HIGHEST)
                           for f in (s.reshape(s.shape[0], -1) for s in stacks)])
    return (_packed(merged),) + _stacked_norm_parts(merged) + (grams,)


@functools.partial(jax.jit, static_argnames=("wires",))
def _decoded_stacks(payloads, scales, wires):
    """Per tensor of a group, [M, *shape] float32: decoded from every member's wire form,
    written once. (Decoding inside the combining program instead is slower: XLA re-decodes in
    each of its passes over the members, or with a barrier holds more at once.)"""
    return tuple(jnp.stack([_decode_traced(p, s, w) for p, s in zip(ps, ss, strict=True)])
                 for ps, ss, w in zip(payloads, scales, wires, strict=True))


def _packed(tensors: Sequence[jax.Array]) -> jax.Array:
    """A group's tensors as the one array its outer step runs on: their concatenation, or a
    lone tensor as it is (a large tensor is a group of its own; copying it would cost memory)."""
    return tensors[0] if len(tensors) == 1 else jnp.concatenate([t.ravel() for t in tensors])


_pack = jax.jit(_packed)


@functools.partial(jax.jit, static_argnames=("shapes",))
def _unpack_concatenated(flat: jax.Array, shapes: tuple[tuple[int, ...], ...]
                         ) -> tuple[jax.Array, ...]:
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[offset:offset + size].reshape(shape))
        offset += size
    return tuple(out)


def _pack_tensors(tensors: Mapping[str, jax.Array], group: Sequence[str]) -> jax.Array:
    """`_packed` of the group's tensors, without a dispatch for a lone tensor."""
    return tensors[group[0]] if len(group) == 1 else _pack(tuple(tensors[n] for n in group))


def _unpack(packed: jax.Array, shapes: tuple[tuple[int, ...], ...]) -> tuple[jax.Array, ...]:
    """The inverse of `_packed`."""
    return (packed,) if len(shapes) == 1 else _unpack_concatenated(packed, shapes)


def _host_gram(stacks: Sequence[jax.Array]) -> np.ndarray:
    """sum over the stacks of their [M, M] Gram matrices, in float32 BLAS on the host, one
    stack at a time (nothing of them is held once this returns)."""
    gram = 0.0
    for stack in stacks:
        flat = np.asarray(stack).reshape(stack.shape[0], -1)
        gram = gram + (flat @ flat.T).astype(np.float64)
    return gram


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
    """Pass 2: merge the kept members' outer gradients group by group and step each group.

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
    with_gram = len(sources) > 1
    gram = np.zeros((len(sources), len(sources)))
    shapes = {n: tuple(params[n].shape) for n in names}
    new_params, state_parts, held = {}, [], []
    merged_peaks, merged_sums, update_peaks, update_sums, grams = [], [], [], [], []
    # A group's working set a parameter: M decoded copies, the merged tensor, the packed
    # parameters and momentum, the step's temporaries, the new values packed and unpacked.
    per_value = 4 * (len(sources) + 8)
    queued_bytes = 0
    for group in _groups(names, shapes, per_value):
        group_shapes = tuple(shapes[n] for n in group)
        cost = per_value * sum(math.prod(s) for s in group_shapes)
        if held and queued_bytes + cost > _GROUP_BYTES:
            jax.block_until_ready(held)     # what is queued finishes before more is dispatched
            held, queued_bytes = [], 0
        where = ("none" if not with_gram else "host"
                 if sum(math.prod(s) for s in group_shapes) > _HOST_GRAM_VALUES else "program")
        kinds = tuple("mean" if rule == "mean" or is_embedding(n)
                      else "expert" if is_expert_stack(n) else "rda" for n in group)
        if stale:   # the anchor's correction op by op, as the fragment-wide merge made it
            stacks = tuple(jnp.stack([_tensor_grad(params, s, n).astype(jnp.float32)
                                      for s in sources]) for n in group)
        else:
            stacks = _decoded_stacks(
                tuple(tuple(s.delta[n].payload for s in sources) for n in group),
                tuple(tuple(s.delta[n].scales for s in sources) for n in group),
                tuple(_Wire.of(sources[0].delta[n]) for n in group))
        merged, peaks, sums, group_grams = _combine(stacks, w, kinds, where)
        merged_peaks.append(peaks)
        merged_sums.append(sums)
        if where == "program":
            grams.append(group_grams)
        elif where == "host":
            gram += _host_gram(stacks)
        del stacks
        old = _pack_tensors(params, group)
        if average:
            new = old - merged
        else:
            stepped, packed_state = outer_step(
                tx, {PACKED: old}, pack_outer_state(
                    outer_state, name_set, lambda d, g=group: _pack_tensors(d, g)),
                {PACKED: merged})
            new = stepped[PACKED]
            state_parts.append((frozenset(group), unpack_outer_state(
                packed_state, lambda v, g=group, s=group_shapes: dict(zip(
                    g, _unpack(v, s), strict=True)))))
        del merged, old
        tensors = _unpack(new, group_shapes)
        del new     # packed copies (a group of several tensors): not kept to the next group
        if not average:
            del stepped, packed_state
        new_params.update(zip(group, tensors, strict=True))
        peaks, sums = _difference_stats(tensors, tuple(params[n] for n in group))
        update_peaks.append(peaks)
        update_sums.append(sums)
        held.append((tensors, state_parts[-1][1] if state_parts else None))
        queued_bytes += cost
    new_state = outer_state if average else join_outer_states(outer_state, name_set, state_parts)
    # One wait at the end: the groups' programs are dispatched without waiting on the host.
    merged_peaks, merged_sums, update_peaks, update_sums, grams = jax.device_get(
        (merged_peaks, merged_sums, update_peaks, update_sums, grams))
    for g in grams:
        gram += g.astype(np.float64).sum(axis=0)
    # The fragment-wide step returned its tensors in sorted order (a pytree map); keep that.
    order = names if average else sorted(names)
    return StreamedMerge({k: new_params[k] for k in order}, new_state,
                         fragment_norm(_pairs(merged_peaks, merged_sums)),
                         fragment_norm(_pairs(update_peaks, update_sums)),
                         _mean_cosine(gram) if with_gram else None)
