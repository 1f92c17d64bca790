"""Fragments: a deterministic, balanced partition of the parameter tensors into P groups.

Decoupled DiLoCo syncs one fragment at a time so that the bytes in flight stay near 1/P of the
model at every moment. The partition is greedy bin-packing (largest tensor first into the lightest
fragment, ties broken by name), which every learner and the syncer compute identically from the
parameter shapes alone. LPT packing is within 4/3 of the optimal peak fragment size.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax

from diloco_core.moe import moe_unit

FlatParams = dict[str, jax.Array]


@dataclass(frozen=True)
class FragmentPlan:
    """Which tensor names belong to which fragment, and each fragment's size in values."""

    fragments: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_of(self, name: str) -> int:
        for p, names in enumerate(self.fragments):
            if name in names:
                return p
        raise KeyError(f"tensor {name!r} is in no fragment")


def plan_fragments(shapes: Mapping[str, Sequence[int]], num_fragments: int) -> FragmentPlan:
    """Greedy balanced bin-packing of tensors (by number of values) into `num_fragments` groups.

    The packed units are single tensors, except that all tensors of one mixture-of-experts layer
    (its router and its expert stacks, `moe.moe_unit`) form one unit: a router is only
    meaningful for the experts it was trained with, so they are synced at the same version.
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    units: dict[str, list[str]] = {}
    for name in shapes:
        units.setdefault(moe_unit(name) or name, []).append(name)
    if num_fragments > len(units):
        raise ValueError(f"num_fragments ({num_fragments}) exceeds the number of parameter tensors "
                         f"(or MoE layers) to split ({len(units)}): a fragment would be empty")
    sized = sorted(((sum(math.prod(shapes[n]) for n in names), unit)
                    for unit, names in units.items()), key=lambda item: (-item[0], item[1]))
    members: list[list[str]] = [[] for _ in range(num_fragments)]
    totals = [0] * num_fragments
    for size, unit in sized:
        # Lightest fragment; ties go to the lowest index so the plan is fully deterministic.
        p = min(range(num_fragments), key=lambda i: (totals[i], i))
        members[p].extend(units[unit])
        totals[p] += size
    return FragmentPlan(tuple(tuple(sorted(m)) for m in members), tuple(totals))


def split_params(params: Mapping[str, jax.Array], plan: FragmentPlan) -> list[FlatParams]:
    """The P fragments of a flat parameter dict (views, no copies)."""
    missing = set(params) - {n for names in plan.fragments for n in names}
    if missing:
        raise KeyError(f"tensors not covered by the fragment plan: {sorted(missing)}")
    return [{name: params[name] for name in names} for names in plan.fragments]


def join_fragments(fragments: Sequence[Mapping[str, jax.Array]]) -> FlatParams:
    """Inverse of `split_params`."""
    joined: FlatParams = {}
    for fragment in fragments:
        overlap = joined.keys() & fragment.keys()
        if overlap:
            raise ValueError(f"tensors in more than one fragment: {sorted(overlap)}")
        joined.update(fragment)
    return joined


def due_fragment(step: int, sync_period: int, num_fragments: int) -> int | None:
    """The fragment that comes due after `step` completed learner steps, or None.

    One fragment comes due every H/P steps, cycling 0, 1, ..., P-1, so each fragment comes due
    exactly once every H steps and consecutive fragments are offset by H/P steps.
    """
    interval = sync_period // num_fragments
    if step <= 0 or step % interval:
        return None
    return (step // interval - 1) % num_fragments


def fragment_of_round(round_index: int, num_fragments: int) -> int:
    """Rounds cycle through the fragments in order: round r syncs fragment r mod P."""
    return round_index % num_fragments
