"""Hand-derived golden numbers for merge weights, RDA, the outer Nesterov step and one round.

The "model" here is a single linear weight vector with constant init, so every number can be
worked out on paper; the derivations are in the comments.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_core.compression import encode
from diloco_core.config import OuterOptConfig, SyncConfig
from diloco_core.contribution import Contribution
from diloco_core.fragments import plan_fragments
from diloco_core.merge import (
    mean_pairwise_cosine,
    merge_outer_grads,
    radial_directional_average,
    weighted_mean,
)
from diloco_core.outer import build_outer_optimizer, outer_step
from diloco_core.syncer import SyncerState, merge_round
from diloco_core.weights import merge_weight, normalized_weights

NOT_EMBEDDING = lambda name: False  # noqa: E731


def test_token_weights_by_hand():
    # w = tokens^2 / steps: 100 tokens in 2 steps -> 100*100/2 = 5000; 300 in 2 -> 45000.
    assert merge_weight(100, 2) == 5000.0
    assert merge_weight(300, 2) == 45000.0
    # Zero steps: nothing to merge, weight 0, no division by zero.
    assert merge_weight(0, 0) == 0.0
    # Normalised: 5000 / 50000 = 0.1 and 45000 / 50000 = 0.9.
    np.testing.assert_allclose(normalized_weights([100, 300], [2, 2]), [0.1, 0.9])
    # Same tokens, more steps (smaller batches): 200^2/4 = 10000 vs 200^2/2 = 20000 -> 1/3, 2/3.
    np.testing.assert_allclose(normalized_weights([200, 200], [4, 2]), [1 / 3, 2 / 3])
    np.testing.assert_allclose(normalized_weights([1, 500], [1, 9], "uniform"), [0.5, 0.5])
    with pytest.raises(ValueError, match="all merge weights are zero"):
        normalized_weights([0, 0], [0, 0])


def test_rda_keeps_equal_norms_and_averages_directions():
    # Two orthogonal vectors of norm 2: e1*2 and e2*2. Equal weights.
    # Radius = 0.5*2 + 0.5*2 = 2; direction = unit(0.5*e1 + 0.5*e2) = (1, 1)/sqrt(2).
    # RDA = 2 * (1, 1)/sqrt(2) = (sqrt(2), sqrt(2)), norm 2 (the plain mean has norm sqrt(2)).
    stack = jnp.array([[2.0, 0.0], [0.0, 2.0]])
    w = jnp.array([0.5, 0.5])
    rda = radial_directional_average(stack, w)
    np.testing.assert_allclose(rda, [np.sqrt(2), np.sqrt(2)], rtol=1e-6)
    np.testing.assert_allclose(jnp.linalg.norm(rda), 2.0, rtol=1e-6)
    np.testing.assert_allclose(weighted_mean(stack, w), [1.0, 1.0])


def test_rda_weighted_norms_and_zero_vector():
    # Norms 3 (along e1) and 1 (along e2), weights 0.75 / 0.25.
    # Radius = 0.75*3 + 0.25*1 = 2.5; direction = unit(0.75*e1 + 0.25*e2) = (3, 1)/sqrt(10).
    stack = jnp.array([[3.0, 0.0], [0.0, 1.0]])
    rda = radial_directional_average(stack, jnp.array([0.75, 0.25]))
    np.testing.assert_allclose(rda, 2.5 * np.array([3.0, 1.0]) / np.sqrt(10), rtol=1e-6)
    # phi(0) = 0: a zero outer gradient adds no direction but counts in the radius:
    # radius = 0.5*0 + 0.5*4 = 2, direction = e1 -> (2, 0).
    rda0 = radial_directional_average(jnp.array([[0.0, 0.0], [4.0, 0.0]]), jnp.array([0.5, 0.5]))
    np.testing.assert_allclose(rda0, [2.0, 0.0], rtol=1e-6)
    assert bool(jnp.all(jnp.isfinite(radial_directional_average(jnp.zeros((2, 3)),
                                                                jnp.array([0.5, 0.5])))))


def test_rda_and_norms_of_huge_finite_outer_gradients_stay_finite():
    # The same golden case as above scaled by 1e19: |g|^2 = 9e38 overflows float32 (max 3.4e38)
    # when squared unscaled, which turned RDA into NaN before it was norm-screened.
    big = 1e19
    stack = jnp.array([[3.0 * big, 0.0], [0.0, 1.0 * big]], jnp.float32)
    rda = radial_directional_average(stack, jnp.array([0.75, 0.25]))
    np.testing.assert_allclose(rda / big, 2.5 * np.array([3.0, 1.0]) / np.sqrt(10), rtol=1e-5)
    from diloco_core.merge import tree_norm
    assert tree_norm({"a": stack[0], "b": stack[1]}) == pytest.approx(np.sqrt(10) * big,
                                                                       rel=1e-5)


def test_embeddings_take_the_mean_under_rda():
    grads = [{"embed": jnp.array([2.0, 0.0]), "w": jnp.array([2.0, 0.0])},
             {"embed": jnp.array([0.0, 2.0]), "w": jnp.array([0.0, 2.0])}]
    merged = merge_outer_grads(grads, np.array([0.5, 0.5]), "rda", lambda n: n == "embed")
    np.testing.assert_allclose(merged["embed"], [1.0, 1.0])               # mean
    np.testing.assert_allclose(merged["w"], [np.sqrt(2), np.sqrt(2)], rtol=1e-6)  # RDA


def test_two_nesterov_outer_steps_by_hand():
    # lr 0.5, mu 0.9, Theta0 = 1.0, outer gradients g1 = 0.2 then g2 = 0.1.
    # Step 1: b1 = 0.9*0 + 0.2 = 0.2; update = g1 + mu*b1 = 0.2 + 0.18 = 0.38;
    #         Theta1 = 1 - 0.5*0.38 = 0.81.
    # Step 2: b2 = 0.9*0.2 + 0.1 = 0.28; update = 0.1 + 0.9*0.28 = 0.352;
    #         Theta2 = 0.81 - 0.5*0.352 = 0.634.
    tx = build_outer_optimizer(OuterOptConfig(lr=0.5, momentum=0.9, momentum_warmup_steps=0))
    theta = {"w": jnp.array([1.0])}
    state = tx.init(theta)
    theta, state = outer_step(tx, theta, state, {"w": jnp.array([0.2])})
    np.testing.assert_allclose(theta["w"], [0.81], rtol=1e-6)
    theta, state = outer_step(tx, theta, state, {"w": jnp.array([0.1])})
    np.testing.assert_allclose(theta["w"], [0.634], rtol=1e-6)


def test_momentum_warmup_ramps_each_fragments_momentum_from_zero():
    # lr 0.5, mu 0.9 reached after W = 2 outer steps; Theta0 = 1, g = 0.2, 0.1, 0.1.
    # Step 0, mu 0:    b = 0.2;                 update = 0.2;                Theta = 0.9.
    # Step 1, mu 0.45: b = 0.45*0.2 + 0.1 = 0.19; update = 0.1 + 0.45*0.19 = 0.1855;
    #                  Theta = 0.9 - 0.09275 = 0.80725.
    # Step 2, mu 0.9:  b = 0.9*0.19 + 0.1 = 0.271; update = 0.1 + 0.9*0.271 = 0.3439;
    #                  Theta = 0.80725 - 0.17195 = 0.6353.
    tx = build_outer_optimizer(OuterOptConfig(lr=0.5, momentum=0.9, momentum_warmup_steps=2))
    theta = {"w": jnp.array([1.0])}
    state = tx.init(theta)
    for g, expected in ((0.2, 0.9), (0.1, 0.80725), (0.1, 0.6353)):
        theta, state = outer_step(tx, theta, state, {"w": jnp.array([g])})
        np.testing.assert_allclose(theta["w"], [expected], rtol=1e-6)
    # The ramp's position is part of the fragment's state: a copy rebuilt from its leaves (as
    # the store restores it) takes the same next step.
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
    restored = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tx.init(theta)), leaves)
    a, _ = outer_step(tx, theta, state, {"w": jnp.array([0.1])})
    b, _ = outer_step(tx, theta, restored, {"w": jnp.array([0.1])})
    np.testing.assert_array_equal(a["w"], b["w"])


def test_the_inner_lr_schedule_decays_each_fragments_outer_lr_by_hand():
    # lr 0.5, no momentum, lr_schedule "inner" over a horizon of 4 outer steps, floor 0.1:
    # lr_n = 0.5 * (0.1 + 0.9 * (1 + cos(pi * n / 4)) / 2) = 0.5, 0.4268, 0.275, 0.1232, 0.05
    # (and 0.05 after the horizon). Theta0 = 1, g = 0.2 at every step.
    cfg = OuterOptConfig(lr=0.5, momentum=0.0, lr_schedule="inner")
    tx = build_outer_optimizer(cfg, horizon_steps=4, min_lr_ratio=0.1)
    theta = {"w": jnp.array([1.0])}
    state = tx.init(theta)
    expected = 1.0
    for n in range(6):
        lr = 0.5 * (0.1 + 0.9 * (1 + np.cos(np.pi * min(n, 4) / 4)) / 2)
        expected -= lr * 0.2
        theta, state = outer_step(tx, theta, state, {"w": jnp.array([0.2])})
        np.testing.assert_allclose(theta["w"], [expected], rtol=1e-6)
    # A constant schedule keeps lr: six steps of 0.5 * 0.2.
    tx = build_outer_optimizer(OuterOptConfig(lr=0.5, momentum=0.0), 4, 0.1)
    theta, state = {"w": jnp.array([1.0])}, None
    state = tx.init(theta)
    for _ in range(6):
        theta, state = outer_step(tx, theta, state, {"w": jnp.array([0.2])})
    np.testing.assert_allclose(theta["w"], [1.0 - 6 * 0.1], rtol=1e-6)


def test_the_outer_schedule_spans_the_runs_outer_steps_per_fragment():
    from diloco_core.config_loading import config_from_mapping

    cfg = config_from_mapping({"token_budget": 1_000_000, "outer": {"lr_schedule": "inner"},
                               "sync": {"sync_period": 8}})
    # 1M tokens / (4 learners x 16 x 128 tokens a step) = 122 inner steps; H = 8: 15 outer
    # steps per fragment.
    assert cfg.total_learner_steps == 122 and cfg.outer_steps_per_fragment == 122 // 8


def _contribution(learner, theta_m, global_value, tokens=64, steps=2, base_version=0):
    delta = {"w": encode(jnp.asarray(global_value - theta_m), "fp32", 64)}
    return Contribution(learner, 0, 0, base_version, tokens, steps, steps, 0.0, delta)


def test_one_round_with_two_learners_lr1_mom0_gives_their_mean():
    # Theta = (1, 1). Learner a trained to (0, 2), learner b to (2, 4), equal tokens and steps.
    # Outer grads: Theta - theta = (1, -1) and (-1, -3); mean = (0, -2);
    # Theta' = Theta - 1*(0, -2) = (1, 3) = mean of the learners' params.
    theta = {"w": jnp.array([1.0, 1.0])}
    plan = plan_fragments({"w": (2,)}, 1)
    tx = build_outer_optimizer(OuterOptConfig(lr=1.0, momentum=0.0))
    state = SyncerState.start([theta], tx)
    cfg = SyncConfig(num_fragments=1, sync_period=4, merge_rule="mean", encoding="fp32")
    contribs = [_contribution("a", jnp.array([0.0, 2.0]), theta["w"]),
                _contribution("b", jnp.array([2.0, 4.0]), theta["w"])]
    state, record = merge_round(state, plan, 0, 0, contribs, cfg, tx, NOT_EMBEDDING, "test")
    assert record.merged and record.members == ("a", "b") and state.versions == (1,)
    np.testing.assert_allclose(state.fragments[0]["w"], [1.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(record.weights, [0.5, 0.5])


def test_stale_contribution_is_anchored_at_the_current_global():
    # Version 0: Theta = 0. A first round moves Theta to 1 (learner "a" at 1, lr 1, mu 0).
    # Learner "b" started from version 0 and reached 0.5: delta_b = 0 - 0.5 = -0.5.
    # Anchor "global": g_b = (Theta_1 - Theta_0) + delta_b = 1 - 0.5 = 0.5 = Theta_1 - theta_b,
    # so with lr 1 Theta_2 = 1 - 0.5 = 0.5 = theta_b. Anchor "base": g_b = -0.5 -> Theta_2 = 1.5.
    plan = plan_fragments({"w": (1,)}, 1)
    tx = build_outer_optimizer(OuterOptConfig(lr=1.0, momentum=0.0))
    for anchor, expected in (("global", 0.5), ("base", 1.5)):
        cfg = SyncConfig(num_fragments=1, sync_period=4, merge_rule="mean", encoding="fp32",
                         anchor=anchor)
        state = SyncerState.start([{"w": jnp.array([0.0])}], tx)
        state, _ = merge_round(state, plan, 0, 0,
                               [_contribution("a", jnp.array([1.0]), jnp.array([0.0]))],
                               cfg, tx, NOT_EMBEDDING, "r0")
        stale = _contribution("b", jnp.array([0.5]), jnp.array([0.0]), base_version=0)
        state, record = merge_round(state, plan, 1, 0, [stale], cfg, tx, NOT_EMBEDDING, "r1")
        assert record.merged, record
        np.testing.assert_allclose(state.fragments[0]["w"], [expected], rtol=1e-6)


def test_bad_contributions_are_rejected_with_a_reason():
    plan = plan_fragments({"w": (2,)}, 1)
    tx = build_outer_optimizer(OuterOptConfig(lr=1.0, momentum=0.0))
    state = SyncerState.start([{"w": jnp.zeros(2)}], tx)
    cfg = SyncConfig(num_fragments=1, sync_period=4, encoding="fp32")
    nan = _contribution("nan", jnp.array([jnp.nan, 0.0]), jnp.zeros(2))
    idle = _contribution("idle", jnp.ones(2), jnp.zeros(2), steps=0, tokens=0)
    good = _contribution("good", jnp.ones(2), jnp.zeros(2))
    state, record = merge_round(state, plan, 0, 0, [nan, idle, good], cfg, tx, NOT_EMBEDDING, "t")
    assert record.members == ("good",)
    assert "NaN" in record.rejected["nan"]
    assert "no progress" in record.rejected["idle"]
    _, none = merge_round(state, plan, 1, 0, [nan], cfg, tx, NOT_EMBEDDING, "t")
    assert not none.merged and "rejected" in none.reason


def test_mean_pairwise_cosine_by_hand():
    x = {"a": jnp.array([1.0, 0.0]), "b": jnp.array([0.0])}
    y = {"a": jnp.array([0.0, 2.0]), "b": jnp.array([0.0])}
    z = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([0.0])}
    assert mean_pairwise_cosine([x, y]) == pytest.approx(0.0)
    assert mean_pairwise_cosine([x, z]) == pytest.approx(1.0)
    assert mean_pairwise_cosine([x, y, z]) == pytest.approx(1 / 3)   # pairs: 0, 1, 0
    assert mean_pairwise_cosine([x]) is None
