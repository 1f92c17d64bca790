import jax.numpy as jnp
import pytest

from diloco_core.fragments import (
    due_fragment,
    fragment_of_round,
    join_fragments,
    plan_fragments,
    split_params,
)


def test_balanced_bin_packing_largest_first_ties_by_name():
    # Sizes: a=8, b=6, c=4, d=4, e=2 into 2 fragments.
    # a(8)->f0; b(6)->f1; c(4)->f1 (6<8) =10; d(4)->f0 =12; e(2)->f1 =12.
    plan = plan_fragments({"a": (8,), "b": (2, 3), "c": (4,), "d": (2, 2), "e": (2,)}, 2)
    assert plan.fragments == (("a", "d"), ("b", "c", "e"))
    assert plan.sizes == (12, 12)
    assert plan.fragment_of("e") == 1


def test_plan_is_deterministic_and_balanced_within_lpt_bound():
    shapes = {f"t{i}": (i % 7 + 1, 3) for i in range(40)}
    plan = plan_fragments(shapes, 5)
    assert plan == plan_fragments(dict(reversed(list(shapes.items()))), 5)
    total = sum(plan.sizes)
    assert max(plan.sizes) <= 4 / 3 * max(total / 5, max(a * b for a, b in shapes.values()))


def test_split_then_join_is_identity():
    params = {f"p{i}": jnp.full((i + 1,), float(i)) for i in range(6)}
    plan = plan_fragments({k: v.shape for k, v in params.items()}, 3)
    frags = split_params(params, plan)
    assert len(frags) == 3
    joined = join_fragments(frags)
    assert joined.keys() == params.keys()
    assert all(joined[k] is params[k] for k in params)


def test_too_many_fragments_and_uncovered_tensors_are_errors():
    with pytest.raises(ValueError, match="exceeds the number of parameter tensors"):
        plan_fragments({"a": (1,)}, 2)
    plan = plan_fragments({"a": (1,)}, 1)
    with pytest.raises(KeyError, match="not covered"):
        split_params({"a": jnp.zeros(1), "b": jnp.zeros(1)}, plan)


def test_staggered_schedule_each_fragment_once_per_sync_period():
    h, p = 8, 4
    due = [due_fragment(step, h, p) for step in range(1, 33)]
    # One fragment every H/P = 2 steps, cycling 0..3.
    assert due[:8] == [None, 0, None, 1, None, 2, None, 3]
    for frag in range(p):
        steps = [s for s in range(1, 33) if due_fragment(s, h, p) == frag]
        assert all(b - a == h for a, b in zip(steps, steps[1:], strict=False))
        assert steps[0] == 2 * (frag + 1)   # evenly offset by H/P
    assert [fragment_of_round(r, p) for r in range(6)] == [0, 1, 2, 3, 0, 1]
