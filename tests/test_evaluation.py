"""Held-out evaluation and generation."""

import math

import jax
import numpy as np

from diloco_core.config import ModelConfig
from diloco_core.evaluation import evaluate, generate
from diloco_core.model import init_model
from diloco_core.objectives import next_token_loss

TINY = ModelConfig.from_preset("tiny")


def _batches(n=3, b=4, length=32, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, b, length), dtype=np.int32)


def test_bits_per_byte_is_loss_over_ln2_and_matches_per_batch_losses():
    model_def, params = init_model(TINY, seed=0)
    batches = _batches()
    result = evaluate(model_def, params, batches)
    assert set(result) == {"loss", "bits_per_byte"}
    assert math.isclose(result["bits_per_byte"], result["loss"] / math.log(2), rel_tol=1e-12)
    loss_fn = jax.jit(next_token_loss, static_argnums=0)
    per_batch = [float(loss_fn(model_def, params, b)) for b in batches]
    assert math.isclose(result["loss"], float(np.mean(per_batch)), rel_tol=1e-5)


def test_random_init_loss_is_near_uniform():
    model_def, params = init_model(TINY, seed=1)
    loss = evaluate(model_def, params, _batches(seed=1))["loss"]
    assert abs(loss - math.log(256)) < 0.5, loss


def test_generate_length_and_determinism():
    model_def, params = init_model(TINY, seed=0)
    greedy = generate(model_def, params, b"def main():", 20)
    assert isinstance(greedy, bytes) and len(greedy) == 20
    assert generate(model_def, params, b"def main():", 20) == greedy
    sampled = generate(model_def, params, b"def main():", 20, temperature=1.0, seed=7)
    assert len(sampled) == 20
    assert generate(model_def, params, b"def main():", 20, temperature=1.0, seed=7) == sampled
    assert generate(model_def, params, b"x", 0) == b""


def test_generate_slides_past_max_seq_len():
    model_def, params = init_model(TINY, seed=0)
    long_prompt = bytes(range(97, 123)) * 4  # 104 bytes > max_seq_len 64
    out = generate(model_def, params, long_prompt, TINY.max_seq_len + 10)
    assert len(out) == TINY.max_seq_len + 10
    assert len(generate(model_def, params, b"", 5)) == 5
