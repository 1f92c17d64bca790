"""The digits task: the data set and its split into disjoint learner shards, the resumable image
iterator, the vision transformer, the task's config checks, and a short simulated run."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_core.config import ConfigError, ModelConfig
from diloco_core.config_loading import config_from_mapping, overrides_to_mapping
from diloco_core.evaluation import evaluate
from diloco_core.image_data import ExampleIterator, Examples, split_examples
from diloco_core.model import apply_model_with_aux, init_model
from diloco_core.vit import patchify
from resources.digits import load_digits_examples
from resources.task_data import load_task_data

VIT = ModelConfig.from_preset("vit-digits")
DIGITS = ["task=digits", "model.preset=vit-digits", "data.batch_size=16",
          "data.heldout_fraction=0.2", "learners.num_learners=2", "sync.sync_period=20",
          "sync.num_fragments=2", "sync.min_quorum=1", "token_budget=3200", "inner.lr=0.003",
          "inner.warmup_steps=5", "simulation.eval_points=2", "name=digits"]


def _cfg(extra=()):
    return config_from_mapping(overrides_to_mapping(DIGITS + list(extra)))


@pytest.fixture(scope="module")
def digits():
    return load_digits_examples()


def test_the_digits_ship_with_scikit_learn(digits):
    assert len(digits) == 1797 and digits.images.shape == (1797, 8, 8)
    assert digits.images.dtype == np.float32
    assert digits.images.min() >= 0.0 and digits.images.max() == 1.0
    assert set(np.unique(digits.labels)) == set(range(10))


def test_split_is_disjoint_complete_balanced_and_seeded(digits):
    shards, held = split_examples(digits, 4, 0.2, seed=0)
    assert len(held) == round(0.2 * 1797)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) + len(held) == 1797
    # Disjoint and complete: every image lands exactly once (images are distinct rows).
    keys = [bytes(img.tobytes()) + bytes([lab]) for part in [*shards, held]
            for img, lab in zip(part.images, part.labels, strict=True)]
    everything = {bytes(img.tobytes()) + bytes([lab])
                  for img, lab in zip(digits.images, digits.labels, strict=True)}
    assert len(keys) == 1797 and set(keys) == everything
    again, held_again = split_examples(digits, 4, 0.2, seed=0)
    assert np.array_equal(held.labels, held_again.labels)
    other, _ = split_examples(digits, 4, 0.2, seed=1)
    assert not np.array_equal(shards[0].labels, other[0].labels)
    # Every learner sees every class.
    assert all(set(np.unique(s.labels)) == set(range(10)) for s in shards)


def test_example_iterator_covers_each_epoch_and_resumes_exactly(digits):
    shard = digits.take(np.arange(100))
    it = ExampleIterator(shard, batch_size=32, seed=7)
    batch = it.next()
    assert batch["images"].shape == (32, 8, 8) and batch["labels"].dtype == np.int32
    seen = [batch] + [it.next() for _ in range(2)]   # 3 batches of 32 = one epoch of 100
    rows = np.concatenate([b["images"].reshape(32, -1) for b in seen])
    assert len({r.tobytes() for r in rows}) == 96
    state = it.state()
    expected = [it.next() for _ in range(4)]
    resumed = ExampleIterator(shard, batch_size=32, seed=7, state=state)
    for want in expected:
        got = resumed.next()
        assert np.array_equal(got["images"], want["images"])
        assert np.array_equal(got["labels"], want["labels"])
    with pytest.raises(ValueError, match="batch_size"):
        ExampleIterator(shard, batch_size=101)


def test_patchify_cuts_row_major_square_patches():
    image = jnp.arange(16, dtype=jnp.float32).reshape(1, 4, 4)
    patches = patchify(image, 2)
    assert patches.shape == (1, 4, 4)
    np.testing.assert_array_equal(patches[0, 0], [0, 1, 4, 5])
    np.testing.assert_array_equal(patches[0, 1], [2, 3, 6, 7])
    np.testing.assert_array_equal(patches[0, 3], [10, 11, 14, 15])


def test_vit_logits_shape_and_uniform_start(digits):
    model_def, params = init_model(VIT, seed=0)
    assert "patch_embed/kernel" in params and params["pos_embed"].shape == (16, VIT.d_model)
    logits, aux = jax.jit(apply_model_with_aux, static_argnums=0)(
        model_def, params, jnp.asarray(digits.images[:5]))
    assert logits.shape == (5, 10) and float(aux) == 0.0
    metrics = evaluate(model_def, params, digits.take(np.arange(50)).as_batch())
    assert metrics["loss"] == pytest.approx(math.log(10), abs=1e-5)   # zero-initialised head
    assert set(metrics) == {"loss", "accuracy"}


def test_vit_moe_variant_builds_and_routes(digits):
    cfg = ModelConfig.from_preset("vit-moe-digits")
    model_def, params = init_model(cfg, seed=0)
    assert params["blocks/0/moe/experts_up"].shape == (4, 64, 64)
    _, aux = apply_model_with_aux(model_def, params, jnp.asarray(digits.images[:8]))
    assert float(aux) > 0


@pytest.mark.parametrize("overrides, field", [
    (["model.preset=small"], "model.family"),
    (["model.patch_size=3"], "model.patch_size"),
    (["model.patch_size=1"], "model.max_seq_len"),
    (["task=pictures"], "task")])
def test_bad_digits_configs_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        _cfg(overrides)
    assert err.value.field == field


def test_text_task_rejects_a_vision_model():
    with pytest.raises(ConfigError, match="model.family"):
        config_from_mapping(overrides_to_mapping(["model.preset=vit-digits"]))


def test_a_budget_counts_images_for_digits():
    cfg = _cfg()
    assert cfg.tokens_per_learner_step == 16
    assert cfg.total_learner_steps == 3200 // (2 * 16)


@pytest.mark.slow
def test_decoupled_diloco_learns_the_digits():
    from diloco_core.simulator import run_simulation

    cfg = _cfg()
    data = load_task_data(cfg)
    assert isinstance(data.heldout_stream, Examples) and len(data.learner_streams) == 2
    result = run_simulation(cfg, data.learner_streams, data.heldout_stream)
    first, last = result.evals[0], result.evals[-1]
    assert last["tokens"] >= 3200 and result.tokens_processed >= 3200
    assert last["accuracy"] > 0.5 and last["loss"] < math.log(10) - 0.5, result.evals
    assert first["accuracy"] <= last["accuracy"]
    assert all(m.merged for m in result.merges[-2:])
