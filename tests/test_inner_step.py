"""The learner's inner step and its optimizer: learning, counters, decay mask, lr schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_core.config import InnerOptConfig, ModelConfig
from diloco_core.inner_optimizer import build_inner_optimizer, lr_at, weight_decay_mask
from diloco_core.inner_step import InnerStep
from diloco_core.model import init_model, is_norm_scale

TINY = ModelConfig.from_preset("tiny")


def _batch(b=4, length=32, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (b, length), dtype=np.int32)


def test_loss_decreases_on_a_repeated_batch_and_counters_advance():
    model_def, params = init_model(TINY, seed=0)
    steps = 30
    inner = InnerStep(model_def, InnerOptConfig(lr=1e-2, warmup_steps=5), total_steps=steps)
    state = inner.init(params)
    batch = _batch()
    losses = []
    for _ in range(steps):
        state, metrics = inner.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert set(metrics) == {"loss", "grad_norm", "lr"}
    assert losses[-1] < losses[0] - 1.0, losses
    assert int(state.step) == steps
    assert int(state.tokens) == steps * inner.tokens_per_batch(batch) == steps * 4 * 32
    assert state.tokens.dtype == jnp.int32
    # init copies: donating the state never deletes the caller's params.
    assert not any(p.is_deleted() for p in params.values())
    # Counters are not donated: a state adopting another's step count leaves the other intact.
    other = inner.init(params)
    adopted = other.replace(step=state.step, tokens=state.tokens)
    adopted, _ = inner.step(adopted, batch)
    assert int(state.step) == steps and int(adopted.step) == steps + 1


def test_step_metrics_report_the_scheduled_lr():
    model_def, params = init_model(TINY, seed=0)
    cfg = InnerOptConfig(lr=1e-3, warmup_steps=4)
    inner = InnerStep(model_def, cfg, total_steps=20)
    state = inner.init(params)
    for step in range(6):
        state, metrics = inner.step(state, _batch(seed=step))
        assert float(metrics["lr"]) == pytest.approx(lr_at(cfg, 20, step), rel=1e-6)
        assert np.isfinite(float(metrics["grad_norm"]))


def test_weight_decay_skips_norm_scales():
    _, params = init_model(TINY, seed=0)
    mask = weight_decay_mask(params)
    undecayed = {n for n, decays in mask.items() if not decays}
    assert undecayed == {n for n in params if is_norm_scale(n)}
    assert sum(not d for d in mask.values()) == 2 * TINY.n_layers + 1
    # With zero gradients Adam's step is 0, so the update is pure decay: -lr * wd * param.
    cfg = InnerOptConfig(lr=0.5, weight_decay=0.1, warmup_steps=0, schedule="constant",
                         clip_norm=0.0)
    opt = build_inner_optimizer(cfg, total_steps=10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(opt.update)(zeros, opt.init(params), params)
    for name, update in updates.items():
        expected = np.zeros_like(params[name]) if is_norm_scale(name) else -0.05 * params[name]
        np.testing.assert_allclose(update, expected, rtol=1e-6, atol=1e-8, err_msg=name)


def test_cosine_schedule_values():
    cfg = InnerOptConfig(lr=1e-3, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    total = 110  # cosine phase: steps 10..110 (100 steps), from 1e-3 down to 1e-4
    assert lr_at(cfg, total, 0) == 0.0
    assert lr_at(cfg, total, 5) == pytest.approx(5e-4)    # halfway up the linear warmup
    assert lr_at(cfg, total, 10) == pytest.approx(1e-3)   # peak
    # step 60: 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + cos(pi * 50/100)) = 1e-4 + 4.5e-4 = 5.5e-4
    assert lr_at(cfg, total, 60) == pytest.approx(5.5e-4)
    # step 35: 1e-4 + 4.5e-4 * (1 + cos(pi/4)) = 1e-4 + 4.5e-4 * 1.70711 = 8.682e-4
    assert lr_at(cfg, total, 35) == pytest.approx(8.682e-4, rel=1e-4)
    assert lr_at(cfg, total, 110) == pytest.approx(1e-4)  # floor = lr * min_lr_ratio
    assert lr_at(cfg, total, 500) == pytest.approx(1e-4)  # stays at the floor
    # An explicit decay_steps replaces total_steps: 60 => cosine over 10..60,
    # step 35: 1e-4 + 4.5e-4 * (1 + cos(pi * 25/50)) = 5.5e-4
    explicit = InnerOptConfig(lr=1e-3, warmup_steps=10, schedule="cosine", decay_steps=60,
                              min_lr_ratio=0.1)
    assert lr_at(explicit, total, 35) == pytest.approx(5.5e-4)


def test_constant_schedule_values():
    cfg = InnerOptConfig(lr=2e-3, warmup_steps=4, schedule="constant")
    assert lr_at(cfg, 100, 0) == 0.0
    assert lr_at(cfg, 100, 1) == pytest.approx(5e-4)  # 2e-3 * 1/4
    assert lr_at(cfg, 100, 4) == pytest.approx(2e-3)
    assert lr_at(cfg, 100, 99) == pytest.approx(2e-3)


def test_wsd_schedule_values():
    """Warmup, the peak held, then a linear decay to the floor over the horizon's last share."""
    cfg = InnerOptConfig(lr=1e-3, warmup_steps=10, schedule="wsd", wsd_decay_fraction=0.2,
                         min_lr_ratio=0.1)
    total = 100  # decay over steps 80..100, from 1e-3 down to 1e-4
    assert lr_at(cfg, total, 5) == pytest.approx(5e-4)    # halfway up the linear warmup
    for step in (10, 50, 80):
        assert lr_at(cfg, total, step) == pytest.approx(1e-3), step
    assert lr_at(cfg, total, 90) == pytest.approx(5.5e-4)  # halfway down
    assert lr_at(cfg, total, 100) == pytest.approx(1e-4)
    assert lr_at(cfg, total, 500) == pytest.approx(1e-4)   # stays at the floor
    # A horizon too short for a stable phase decays straight after the warmup.
    assert lr_at(cfg, 12, 10) == pytest.approx(1e-3)
    assert lr_at(cfg, 12, 11) == pytest.approx(5.5e-4)
    # An explicit decay_steps is the horizon: 50 => decay over 40..50.
    explicit = InnerOptConfig(lr=1e-3, warmup_steps=10, schedule="wsd", decay_steps=50)
    assert lr_at(explicit, total, 40) == pytest.approx(1e-3)
    assert lr_at(explicit, total, 45) == pytest.approx(5.5e-4)


def test_budget_shorter_than_warmup_still_builds():
    cfg = InnerOptConfig(lr=1e-3, warmup_steps=20)
    assert lr_at(cfg, 5, 10) == pytest.approx(5e-4)
