"""Mixture-of-experts MLP: a learned router sends each token to its top-k of E gated MLPs.

- Routing: softmax router probabilities over E experts; each token goes to its k most probable
  experts, mixed by those probabilities renormalised over the k (top-k gating, as in GShard,
  Switch and Mixtral).
- Load balancing: the auxiliary loss E * sum_e f_e * P_e (Switch Transformer), f_e the share of
  the token-to-expert assignments that went to expert e and P_e its mean router probability.
  It is 1 when both are uniform and grows as the router concentrates; the learner adds
  `router_aux_weight` times it to its training loss. Each learner computes it on its own
  batches only (as in the paper): balancing needs no communication between learners.
- Compute: every expert runs on every token and the unselected outputs get weight 0 ("dense
  dispatch"). Exact, shape-static and simple; at this project's CPU scale it costs E/k times
  the active compute, which is acceptable. A capacity-based all-to-all dispatch is what a
  large model on an accelerator slice needs; the parameters and the loss would not change.

Parameters: `router/kernel` [d, E] and the expert stacks `experts_up`, `experts_gate`
[E, d, f] and `experts_down` [E, f, d]. All of one layer's tensors live under `.../moe/`, which
the fragmenter keeps in one fragment (`fragments.py`), and the merge rule treats each expert of
a stack as its own tensor (`merge.py`).
"""

import re

import jax
import jax.numpy as jnp
from flax import nnx

from diloco_core.config import ModelConfig

# The stacked expert tensors [E, ...]: merged expert by expert.
_EXPERT_STACK = re.compile(r"(^|/)moe/experts_[a-z]+$")
# All tensors of one MoE layer share the unit ".../moe" (router and experts synced together).
_MOE_UNIT = re.compile(r"^(.*?/moe)/")


def is_expert_stack(name: str) -> bool:
    """True for a stacked expert tensor (leading axis = expert)."""
    return _EXPERT_STACK.search(name) is not None


def moe_unit(name: str) -> str | None:
    """The MoE layer a tensor belongs to ("blocks/3/moe"), or None for a non-MoE tensor."""
    match = _MOE_UNIT.match(name)
    return None if match is None else match.group(1)


def route(router_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing of tokens [..., E] of router logits.

    Returns (combine [..., E]: each token's weight per expert, zero outside its top k, summing
    to 1; probs [..., E]: the full softmax; chosen [..., E]: 1.0 where the expert is in the
    token's top k).
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, k)
    chosen_k = jax.nn.one_hot(top_i, probs.shape[-1], dtype=jnp.float32)  # [..., k, E]
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    combine = jnp.einsum("...k,...ke->...e", gates, chosen_k)
    return combine, probs, jnp.sum(chosen_k, axis=-2)


def load_balancing_loss(probs: jax.Array, chosen: jax.Array) -> jax.Array:
    """E * sum_e f_e * P_e over all tokens of probs/chosen [..., E]; 1.0 when balanced."""
    num_experts = probs.shape[-1]
    flat_probs = probs.reshape(-1, num_experts)
    flat_chosen = chosen.reshape(-1, num_experts)
    share = jnp.sum(flat_chosen, axis=0) / jnp.sum(flat_chosen)     # f_e, sums to 1
    mean_prob = jnp.mean(flat_probs, axis=0)                         # P_e, sums to 1
    return num_experts * jnp.sum(share * mean_prob)


class MoEMLP(nnx.Module):
    """E gated MLPs (down(silu(gate(x)) * up(x)), like the dense MLP) behind a top-k router."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.n_experts
        self.k = cfg.experts_per_token
        self.dtype = jnp.dtype(cfg.dtype)
        # A small router init: routing starts near uniform, so every expert gets trained early.
        self.router = nnx.Linear(d, e, use_bias=False, dtype=jnp.float32,
                                 param_dtype=jnp.float32, rngs=rngs,
                                 kernel_init=nnx.initializers.normal(stddev=0.02))
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                 in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.experts_up = nnx.Param(init(rngs.params(), (e, d, f), jnp.float32))
        self.experts_gate = nnx.Param(init(rngs.params(), (e, d, f), jnp.float32))
        self.experts_down = nnx.Param(init(rngs.params(), (e, f, d), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, L, d] -> (y [B, L, d], load-balancing loss of this layer)."""
        combine, probs, chosen = route(self.router(x.astype(jnp.float32)), self.k)
        xc = x.astype(self.dtype)
        up = jnp.einsum("bld,edf->blef", xc, self.experts_up[...].astype(self.dtype))
        gate = jnp.einsum("bld,edf->blef", xc, self.experts_gate[...].astype(self.dtype))
        out = jnp.einsum("blef,efd->bled", jax.nn.silu(gate) * up,
                         self.experts_down[...].astype(self.dtype))
        y = jnp.einsum("ble,bled->bld", combine.astype(self.dtype), out)
        return y, load_balancing_loss(probs, chosen)
