"""Norm screening: absurd outer gradients are excluded, honest unequal progress is not."""

import math

from diloco_core.screening import screen_norms


def test_an_absurd_norm_is_flagged_with_its_ratio():
    flagged = screen_norms(["a", "b", "c"], [1.0, 1.1, 500.0], [10, 10, 10], 10.0)
    assert list(flagged) == ["c"]
    assert "470" in flagged["c"] or "476" in flagged["c"]


def test_unequal_progress_is_not_an_outlier():
    # A fast learner with 300 steps and a rejoined one with 2 steps: norms differ 100x, but
    # per step they are alike.
    assert screen_norms(["fast", "mid", "new"], [3.0, 1.0, 0.02], [300, 100, 2], 10.0) == {}


def test_two_contributions_or_an_infinite_limit_screen_nothing():
    assert screen_norms(["a", "b"], [1.0, 1e6], [1, 1], 10.0) == {}
    assert screen_norms(["a", "b", "c"], [1.0, 1.0, 1e6], [1, 1, 1], math.inf) == {}


def test_zero_norms_do_not_divide_by_zero():
    assert screen_norms(["a", "b", "c"], [0.0, 0.0, 1.0], [1, 1, 1], 10.0) == {}


def test_below_three_contributions_the_previous_merge_is_the_reference():
    flagged = screen_norms(["a", "b"], [1.0, 1e6], [10, 10], 10.0, reference=0.1)
    assert list(flagged) == ["b"] and "previous merge" in flagged["b"]
    assert list(screen_norms(["a"], [1e3], [1], 10.0, reference=1.0)) == ["a"]
    # Honest progress of a different size is per step, so it passes.
    assert screen_norms(["a", "b"], [30.0, 1.0], [300, 10], 10.0, reference=0.1) == {}
    assert screen_norms(["a", "b"], [1.0, 1e6], [1, 1], 10.0, reference=None) == {}
