"""Mixture-of-experts blocks: top-k routing, the load-balancing loss, shapes, gradient flow, a
dense-equivalence check, and how the fragmenter and the merge rule treat router and experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_core.config import ConfigError, InnerOptConfig, ModelConfig
from diloco_core.fragments import plan_fragments
from diloco_core.inner_step import InnerStep
from diloco_core.merge import merge_outer_grads, radial_directional_average
from diloco_core.model import apply_model, apply_model_with_aux, init_model, is_embedding
from diloco_core.moe import is_expert_stack, load_balancing_loss, moe_unit, route
from diloco_core.objectives import training_loss

MOE = ModelConfig.from_preset("moe-tiny")


def _tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.int32))


def test_route_picks_the_top_k_and_renormalises_their_probabilities():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 7, 6)), jnp.float32)
    combine, probs, chosen = route(logits, k=2)
    np.testing.assert_allclose(probs, jax.nn.softmax(logits, axis=-1), rtol=1e-6)
    assert np.all(np.asarray(chosen).sum(-1) == 2)
    np.testing.assert_allclose(np.asarray(combine).sum(-1), 1.0, rtol=1e-6)
    top2 = np.argsort(-np.asarray(probs), axis=-1)[..., :2]
    for idx in np.ndindex(5, 7):
        nonzero = set(np.flatnonzero(np.asarray(combine)[idx]))
        assert nonzero == set(top2[idx])
        p = np.asarray(probs)[idx][top2[idx]]
        np.testing.assert_allclose(np.asarray(combine)[idx][top2[idx]], p / p.sum(), rtol=1e-5)


def test_load_balancing_loss_is_one_when_balanced_and_e_when_collapsed():
    e = 4
    uniform = jnp.full((8, e), 1.0 / e)
    balanced = jax.nn.one_hot(jnp.arange(8) % e, e)
    assert float(load_balancing_loss(uniform, balanced)) == pytest.approx(1.0)
    collapsed_probs = jax.nn.one_hot(jnp.zeros(8, jnp.int32), e)
    assert float(load_balancing_loss(collapsed_probs, collapsed_probs)) == pytest.approx(e)


def test_moe_model_shapes_names_and_aux_loss():
    model_def, params = init_model(MOE, seed=0)
    e, d, f = MOE.n_experts, MOE.d_model, MOE.d_ff
    assert params["blocks/0/moe/router/kernel"].shape == (d, e)
    assert params["blocks/1/moe/experts_up"].shape == (e, d, f)
    assert params["blocks/1/moe/experts_down"].shape == (e, f, d)
    assert not any("/mlp/" in n for n in params)
    logits, aux = jax.jit(apply_model_with_aux, static_argnums=0)(model_def, params,
                                                                  _tokens((3, 16)))
    assert logits.shape == (3, 16, MOE.vocab_size) and aux.shape == ()
    assert 0.9 < float(aux) < MOE.n_experts   # near-uniform routing at init


def test_one_expert_with_top_1_is_exactly_the_dense_mlp():
    dense_cfg = ModelConfig.from_preset("tiny")
    moe_cfg = ModelConfig.from_preset("tiny", n_experts=1, experts_per_token=1)
    dense_def, dense = init_model(dense_cfg, seed=3)
    moe_def, moe = init_model(moe_cfg, seed=4)
    for name in moe:
        if "/moe/experts_" in name:
            kind = name.rsplit("_", 1)[1]   # up / gate / down
            moe[name] = dense[name.replace(f"moe/experts_{kind}", f"mlp/{kind}/kernel")][None]
        elif "/moe/router" not in name:
            moe[name] = dense[name]
    tokens = _tokens((2, 12))
    np.testing.assert_allclose(apply_model(moe_def, moe, tokens),
                               apply_model(dense_def, dense, tokens), rtol=1e-5, atol=1e-5)


def test_gradients_reach_the_router_and_every_expert():
    model_def, params = init_model(MOE, seed=0)
    grads, metrics = jax.jit(jax.grad(training_loss, argnums=1, has_aux=True),
                             static_argnums=0)(model_def, params, _tokens((4, 32)))
    assert float(metrics["aux_loss"]) > 0
    for layer in range(MOE.n_layers):
        router = np.asarray(grads[f"blocks/{layer}/moe/router/kernel"])
        assert np.abs(router).max() > 0
        for kind in ("up", "gate", "down"):
            per_expert = np.abs(np.asarray(grads[f"blocks/{layer}/moe/experts_{kind}"]))
            assert (per_expert.reshape(MOE.n_experts, -1).max(axis=1) > 0).all()


def test_the_load_balancing_term_is_in_the_objective_with_its_weight():
    model_def, params = init_model(MOE, seed=0)
    tokens = _tokens((2, 16))
    off_def, _ = init_model(ModelConfig.from_preset("moe-tiny", router_aux_weight=0.0), seed=0)
    objective, metrics = training_loss(model_def, params, tokens)
    plain, _ = training_loss(off_def, params, tokens)
    assert float(plain) == pytest.approx(float(metrics["loss"]), rel=1e-6)
    assert float(objective) == pytest.approx(
        float(metrics["loss"]) + MOE.router_aux_weight * float(metrics["aux_loss"]), rel=1e-6)


def test_inner_steps_train_a_moe_model():
    model_def, params = init_model(MOE, seed=0)
    inner = InnerStep(model_def, InnerOptConfig(lr=3e-3, warmup_steps=0), total_steps=30)
    state = inner.init(params)
    batch = _tokens((4, 32), seed=1)
    first = None
    for _ in range(15):
        state, metrics = inner.step(state, batch)
        first = first if first is not None else float(metrics["loss"])
    assert float(metrics["loss"]) < first - 0.5
    assert "aux_loss" in metrics


def test_router_and_experts_of_a_layer_share_a_fragment():
    _, params = init_model(ModelConfig.from_preset("moe-small"), seed=0)
    shapes = {k: v.shape for k, v in params.items()}
    assert moe_unit("blocks/3/moe/router/kernel") == "blocks/3/moe"
    assert moe_unit("blocks/3/attn/q/kernel") is None
    for p in (2, 3, 4):
        plan = plan_fragments(shapes, p)
        for layer in range(6):
            layer_names = [n for n in shapes if n.startswith(f"blocks/{layer}/moe/")]
            assert len(layer_names) == 4
            assert len({plan.fragment_of(n) for n in layer_names}) == 1
        assert sorted(n for f in plan.fragments for n in f) == sorted(shapes)


def test_expert_stacks_merge_expert_by_expert():
    rng = np.random.default_rng(0)
    name = "blocks/0/moe/experts_up"
    assert is_expert_stack(name) and not is_expert_stack("blocks/0/moe/router/kernel")
    # Learner a moved expert 0 a lot and expert 1 little; learner b the other way round.
    a = rng.normal(size=(2, 3, 4)).astype(np.float32)
    b = rng.normal(size=(2, 3, 4)).astype(np.float32)
    a[1] *= 0.01
    b[0] *= 0.01
    router = rng.normal(size=(3, 2)).astype(np.float32)
    grads = [{name: jnp.asarray(a), "r": jnp.asarray(router)},
             {name: jnp.asarray(b), "r": jnp.asarray(-router)}]
    weights = np.array([0.5, 0.5], np.float32)
    merged = merge_outer_grads(grads, weights, "rda", is_embedding)
    for e in range(2):
        expected = radial_directional_average(jnp.stack([a[e], b[e]]), jnp.asarray(weights))
        np.testing.assert_allclose(merged[name][e], expected, rtol=1e-5, atol=1e-7)
    whole = radial_directional_average(jnp.stack([a, b]), jnp.asarray(weights))
    assert not np.allclose(merged[name], whole, rtol=1e-3)


@pytest.mark.parametrize("field, value, match", [
    ("experts_per_token", 5, "experts_per_token"), ("n_experts", -1, "n_experts"),
    ("router_aux_weight", float("nan"), "router_aux_weight")])
def test_bad_moe_settings_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_preset("moe-tiny", **{field: value})
