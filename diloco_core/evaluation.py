"""Held-out loss / bits-per-byte (text) or loss / accuracy (images), and byte-level text
generation."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from diloco_core.model import FlatParams, ModelDef, apply_model
from diloco_core.objectives import classification_metrics, next_token_loss


def _losses(model_def: ModelDef, params: FlatParams, batches: jax.Array) -> jax.Array:
    # lax.map: one dispatch for all N batches, memory of one batch at a time.
    return jax.lax.map(lambda b: next_token_loss(model_def, params, b), batches)


@functools.partial(jax.jit, static_argnums=0)
def _mean_loss(model_def: ModelDef, params: FlatParams, batches: jax.Array) -> jax.Array:
    # Batches share a shape, so the mean of per-batch means is the mean over all predicted
    # tokens.
    return _losses(model_def, params, batches).mean()


_batch_losses = jax.jit(_losses, static_argnums=0)


@functools.partial(jax.jit, static_argnums=0)
def _classification(model_def: ModelDef, params: FlatParams, images: jax.Array,
                    labels: jax.Array) -> dict[str, jax.Array]:
    return classification_metrics(apply_model(model_def, params, images), labels)


def evaluate(model_def: ModelDef, params: FlatParams, batches) -> dict[str, float]:
    """Held-out metrics. Text: mean next-token cross-entropy over batches int32 [N, B, L]:
    {"loss" (nats), "bits_per_byte" (= loss / ln 2: one token is one byte)}. Images (vit):
    {"images": [N, H, W], "labels": [N]} -> {"loss" (nats), "accuracy"}."""
    if model_def.cfg.family == "vit":
        metrics = _classification(model_def, params, jnp.asarray(batches["images"], jnp.float32),
                                  jnp.asarray(batches["labels"], jnp.int32))
        return {k: float(v) for k, v in metrics.items()}
    batches = _text_batches(batches)
    loss = float(_mean_loss(model_def, params, batches))
    return {"loss": loss, "bits_per_byte": loss / math.log(2)}


def _text_batches(batches) -> np.ndarray:
    batches = np.asarray(batches, dtype=np.int32)
    if batches.ndim != 3 or batches.shape[-1] < 2:
        raise ValueError(f"batches must be [N, B, L] with L >= 2, got shape {batches.shape}")
    return batches


def batch_losses(model_def: ModelDef, params: FlatParams, batches) -> np.ndarray:
    """Mean next-token cross-entropy (nats) of each text batch in int32 [N, B, L]: float64 [N],
    for a mean with its standard error over batches."""
    batches = _text_batches(batches)
    return np.asarray(_batch_losses(model_def, params, batches), dtype=np.float64)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _generate(model_def: ModelDef, params: FlatParams, buffer: jax.Array, max_new_tokens: int,
              greedy: bool, length: jax.Array, temperature: jax.Array, key: jax.Array,
              ) -> jax.Array:
    """Append `max_new_tokens` to buffer[:length], re-running the whole fixed-size window.

    Causality makes the padding after `length` invisible to position `length - 1`. When the
    window is full it slides left by one, keeping the most recent tokens.
    """
    window = buffer.shape[0]

    def one(i, carry):
        buf, n, out = carry
        logits = apply_model(model_def, params, buf[None, :])[0, n - 1]
        if greedy:
            token = jnp.argmax(logits).astype(jnp.int32)
        else:
            token = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)
            token = token.astype(jnp.int32)
        full = n == window
        buf = jnp.where(full, jnp.roll(buf, -1), buf)
        buf = buf.at[jnp.where(full, window - 1, n)].set(token)
        return buf, jnp.where(full, n, n + 1), out.at[i].set(token)

    out = jnp.zeros((max_new_tokens,), jnp.int32)
    return jax.lax.fori_loop(0, max_new_tokens, one, (buffer, length, out))[2]


def generate(model_def: ModelDef, params: FlatParams, prompt: bytes, max_new_tokens: int,
             temperature: float = 0.0, seed: int = 0) -> bytes:
    """Continue `prompt` by `max_new_tokens` bytes: greedy at temperature 0, else sampled.

    The context is the last `cfg.max_seq_len` bytes. An empty prompt starts from b"\\n" (the
    byte vocabulary has no BOS token).
    """
    if max_new_tokens < 0 or temperature < 0:
        raise ValueError("max_new_tokens and temperature must be >= 0")
    if max_new_tokens == 0:
        return b""
    context = np.frombuffer(prompt or b"\n", dtype=np.uint8).astype(np.int32)
    max_len = model_def.cfg.max_seq_len
    context = context[-max_len:]
    # Window = smallest multiple of 64 holding prompt + output (capped at max_seq_len): short
    # generations skip the cost of full-length forwards, with few distinct compiled shapes.
    window = min(max_len, -(-(len(context) + max_new_tokens) // 64) * 64)
    buffer = np.zeros((window,), np.int32)
    buffer[: len(context)] = context  # fits: len(context) <= max_len and <= the rounded size
    out = _generate(model_def, params, jnp.asarray(buffer), max_new_tokens, temperature == 0,
                    jnp.int32(len(context)), jnp.float32(max(temperature, 1e-6)),
                    jax.random.key(seed))
    return np.asarray(out, dtype=np.uint8).tobytes()
