"""How far the syncer believes a learner's counters (`diloco_core.corroboration`), by hand."""

import math

import numpy as np
import pytest

from diloco_core.corroboration import (
    cap_shares,
    credit_offer,
    credited_totals,
    offer_step_bound,
    peer_step_bound,
    share_caps,
)


def test_an_offer_is_credited_at_most_the_protocols_pace_times_its_staleness():
    assert offer_step_bound(16, 0, 4.0) == 64
    assert offer_step_bound(16, 2, 4.0) == 192          # it missed two syncs of the fragment
    assert offer_step_bound(16, -3, 4.0) == 64          # never below one sync period's worth
    assert offer_step_bound(16, 0, math.inf) == 2 ** 62
    assert credit_offer(2048, 16, 128, 64) == (2048, 16, None)
    tokens, steps, why = credit_offer(128 * 10 ** 12, 10 ** 12, 128, 64)
    assert (tokens, steps) == (64 * 128, 64) and "credited 8192 in 64" in why
    # Without a known step size only the steps are bounded.
    assert credit_offer(10 ** 9, 10 ** 6, None, 64)[:2] == (10 ** 9, 64)


def test_no_weight_above_its_cap_and_the_rest_keep_their_proportions():
    w = cap_shares([0.0001, 0.0001, 0.9998], [0.5, 0.5, 0.5])
    np.testing.assert_allclose(w, [0.25, 0.25, 0.5])
    w = cap_shares([1, 2, 3, 94], [0.5] * 4)
    assert w[3] == pytest.approx(0.5) and w[:3] / w[0] == pytest.approx([1, 2, 3])
    assert w.sum() == pytest.approx(1.0)
    # Two members: the cap is never below 1/n, so equal weights stay equal.
    np.testing.assert_allclose(cap_shares([1, 1], [0.3, 0.3]), [0.5, 0.5])
    # Uncapped weights are only normalized.
    np.testing.assert_allclose(cap_shares([1, 3], [0.75, 0.75]), [0.25, 0.75])


def test_a_learner_with_a_larger_configured_batch_keeps_its_token_weight():
    caps = share_caps(["a", "b", "c"], {"a": 64, "b": 128, "c": 192}, 0.5)
    assert caps == pytest.approx([0.5, 0.5, 36 / 56])
    w = cap_shares([1, 4, 9], caps)                     # tokens^2 / steps at equal steps
    np.testing.assert_allclose(w, np.array([1, 4, 9]) / 14)
    assert share_caps(["a", "x"], {"a": 64}, 0.5) == [0.5, 0.5]   # unknown learner: the floor


def test_heartbeat_totals_are_credited_up_to_the_other_live_learners():
    claimed = {"a": 1000, "b": 1200, "c": 2 ** 62}
    credited, clipped = credited_totals(claimed, ["a", "b", "c"], 1.0, 100)
    assert credited == {"a": 1000, "b": 1200, "c": 1300} and set(clipped) == {"c"}
    # A liar claiming nothing holds nobody back (the largest of the others is the standard);
    # the one learner furthest ahead counts as the next one plus the slack (the price: a run
    # with a single fastest learner goes on past its budget by that learner's lead).
    credited, _ = credited_totals({"a": 1000, "b": 1050, "c": 0}, ["a", "b", "c"], 1.0, 100)
    assert credited == {"a": 1000, "b": 1050, "c": 0}
    credited, _ = credited_totals({"a": 1000, "b": 5000, "c": 0}, ["a", "b", "c"], 1.0, 100)
    assert credited == {"a": 1000, "b": 1100, "c": 0}
    # Fewer than two other live learners: nothing to compare with, claims count as made.
    credited, clipped = credited_totals(claimed, ["a", "c"], 1.0, 100)
    assert credited == claimed and not clipped
    # A dead learner's stale total is no standard either.
    credited, _ = credited_totals({"a": 10, "b": 5000, "c": 2 ** 62}, ["a", "c", "d"], 1.0, 0)
    assert credited["c"] == 2 ** 62
    credited, _ = credited_totals(claimed, ["a", "b", "c"], 4.0, 0)
    assert credited["c"] == 4800


def test_the_other_members_of_a_round_corroborate_steps_past_the_versions_pace():
    assert peer_step_bound(64, [100, 30], 4.0) == 120      # 4 x the fewest another offered
    assert peer_step_bound(64, [10], 4.0) == 64            # never below the versions' pace
    assert peer_step_bound(64, [], 4.0) == 64              # alone in its round
    assert peer_step_bound(64, [10 ** 6], math.inf) == 64  # no ratio: offer_step_bound's
