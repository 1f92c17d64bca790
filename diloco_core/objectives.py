"""What a learner minimises, per model family, and the structure of a batch (how many
"tokens" it counts, how batches concatenate).

- decoder (task "text"): batch int32 [B, L] of bytes; next-token cross-entropy, B * L tokens.
- vit (task "digits"): batch {"images": float32 [B, H, W], "labels": int32 [B]}; class
  cross-entropy, B tokens (one per image).

With mixture-of-experts blocks the objective adds `router_aux_weight` times the load-balancing
loss; the reported "loss" stays the plain cross-entropy, comparable with dense models.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_core.model import FlatParams, ModelDef, apply_model, apply_model_with_aux

Batch = jax.Array | np.ndarray | Mapping[str, jax.Array | np.ndarray]


def _next_token_ce(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()


def next_token_loss(model_def: ModelDef, params: FlatParams, tokens: jax.Array) -> jax.Array:
    """Mean float32 cross-entropy (nats) of predicting tokens[:, 1:] from tokens[:, :-1]."""
    return _next_token_ce(apply_model(model_def, params, tokens[:, :-1]), tokens)


def classification_metrics(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
    """Mean cross-entropy (nats) and accuracy of logits [B, C] against labels int32 [B]."""
    labels = labels.astype(jnp.int32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
    return {"loss": loss, "accuracy": accuracy}


def training_loss(model_def: ModelDef, params: FlatParams, batch: Batch
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(objective to differentiate, metrics: "loss" = cross-entropy, "accuracy" for images,
    "aux_loss" (the load-balancing loss) for MoE models)."""
    cfg = model_def.cfg
    if cfg.family == "vit":
        logits, aux = apply_model_with_aux(model_def, params, batch["images"])
        metrics = classification_metrics(logits, batch["labels"])
    else:
        tokens = jnp.asarray(batch).astype(jnp.int32)
        logits, aux = apply_model_with_aux(model_def, params, tokens[:, :-1])
        metrics = {"loss": _next_token_ce(logits, tokens)}
    if not cfg.n_experts:
        return metrics["loss"], metrics
    metrics["aux_loss"] = aux
    return metrics["loss"] + cfg.router_aux_weight * aux, metrics


def batch_tokens(batch: Batch) -> int:
    """Tokens a step on `batch` processes: B * L bytes, or B images."""
    if isinstance(batch, Mapping):
        return int(np.prod(np.shape(batch["labels"])))
    return int(np.prod(np.shape(batch)))


def concat_batches(parts: list[Batch]) -> Batch:
    """One global batch from the learners' batches (data-parallel baseline)."""
    if isinstance(parts[0], Mapping):
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return np.concatenate(parts)
