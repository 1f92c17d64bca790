"""A decoder-only transformer in Flax NNX, and its flat-parameter view (of any model family).

Architecture: token embedding, `n_layers` pre-norm blocks (RMSNorm -> causal multi-head attention
with rotary position embeddings -> residual, RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm
and an untied output projection. No biases. Parameters are float32; activations use `cfg.dtype`.

The rest of the code base never touches the module object: parameters travel as `FlatParams`, a
flat dict keyed by "/"-joined paths (e.g. "blocks/0/attn/q/kernel"), because fragments, merges,
wire encodings and checkpoints are all naturally "per named tensor". `ModelDef` holds the static
structure needed to turn such a dict back into a module inside `jax.jit` (functional NNX style:
`nnx.merge` inside the traced function, never `nnx.jit`).
"""

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.tree_util import DictKey, GetAttrKey

from diloco_core.config import ModelConfig
from diloco_core.moe import MoEMLP

FlatParams = dict[str, jax.Array]

# Names of the "embedding component" that Decoupled DiLoCo merges by weighted mean.
EMBEDDING_NAMES = ("embed/embedding", "lm_head/kernel")

_NORM_EPS = 1e-6


def rope_tables(length: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [length, head_dim // 2] for rotary embeddings.

    Built with numpy from static shapes, so under jit they are compile-time constants.
    """
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: jax.Array, cos: np.ndarray, sin: np.ndarray) -> jax.Array:
    """Rotate channel pairs (i, i + H/2) of x [B, L, N, H] by position-dependent angles."""
    half = x.shape[-1] // 2
    # Rotation in float32: bf16 angles would lose positional resolution at long contexts.
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    rotated = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return rotated.astype(x.dtype)


def _linear(d_in: int, d_out: int, cfg: ModelConfig, rngs: nnx.Rngs, **kwargs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=jnp.dtype(cfg.dtype),
                      param_dtype=jnp.float32, rngs=rngs, **kwargs)


def _rms_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(cfg.d_model, epsilon=_NORM_EPS, dtype=jnp.dtype(cfg.dtype),
                       param_dtype=jnp.float32, rngs=rngs)


class Attention(nnx.Module):
    """Multi-head self-attention: causal with rotary position embeddings (decoder), or
    bidirectional without them (vit, whose patches carry learned position embeddings)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.rope_base = cfg.rope_base
        self.causal = cfg.family == "decoder"
        self.q = _linear(cfg.d_model, cfg.d_model, cfg, rngs)
        self.k = _linear(cfg.d_model, cfg.d_model, cfg, rngs)
        self.v = _linear(cfg.d_model, cfg.d_model, cfg, rngs)
        self.o = _linear(cfg.d_model, cfg.d_model, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, length, d = x.shape
        heads = (b, length, self.n_heads, self.head_dim)
        q, k, v = (proj(x).reshape(heads) for proj in (self.q, self.k, self.v))
        if self.causal:
            cos, sin = rope_tables(length, self.head_dim, self.rope_base)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(out.reshape(b, length, d))


class MLP(nnx.Module):
    """Gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.up = _linear(cfg.d_model, cfg.d_ff, cfg, rngs)
        self.gate = _linear(cfg.d_model, cfg.d_ff, cfg, rngs)
        self.down = _linear(cfg.d_ff, cfg.d_model, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP, dense or mixture of experts (`moe.py`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = _rms_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _rms_norm(cfg, rngs)
        if cfg.n_experts:
            self.moe = MoEMLP(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, L, d] -> (x', this block's load-balancing loss; 0 for a dense block)."""
        x = x + self.attn(self.attn_norm(x))
        if hasattr(self, "moe"):
            y, aux = self.moe(self.mlp_norm(x))
            return x + y, aux
        return x + self.mlp(self.mlp_norm(x)), jnp.zeros((), jnp.float32)


def run_blocks(blocks: nnx.List, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The residual stream through every block, and the blocks' mean load-balancing loss."""
    aux = jnp.zeros((), jnp.float32)
    for block in blocks:
        x, block_aux = block(x)
        aux = aux + block_aux
    return x, aux / max(len(blocks), 1)


class Transformer(nnx.Module):
    """Decoder-only language model: tokens int32 [B, L] -> logits float32 [B, L, V]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.max_seq_len = cfg.max_seq_len
        # Unit-scale embeddings: the residual stream starts at RMS ~1, comparable to block
        # outputs; the pre-norms make the blocks insensitive to this scale anyway.
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.dtype(cfg.dtype),
                               param_dtype=jnp.float32,
                               embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = _rms_norm(cfg, rngs)
        # Small output init (logit std ~0.3): a fresh model predicts close to uniform, so its loss
        # starts near ln(vocab) instead of paying for confidently random logits.
        self.lm_head = _linear(cfg.d_model, cfg.vocab_size, cfg, rngs,
                               kernel_init=nnx.initializers.variance_scaling(
                                   0.1, "fan_in", "normal"))

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(logits float32 [B, L, V], mean load-balancing loss of the MoE blocks or 0)."""
        if tokens.shape[-1] > self.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds max_seq_len "
                             f"{self.max_seq_len}")
        x, aux = run_blocks(self.blocks, self.embed(tokens))
        return self.lm_head(self.final_norm(x)).astype(jnp.float32), aux


@dataclass(frozen=True)
class ModelDef:
    """Static structure to apply `FlatParams`: hashable, so it can be a jit static argument.

    `treedef` is the pytree structure of the module's nnx State; `names` lists the flat parameter
    names in that treedef's leaf order.
    """

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    treedef: jax.tree_util.PyTreeDef
    names: tuple[str, ...]

    def to_state(self, params: FlatParams) -> nnx.State:
        missing = set(self.names) - params.keys()
        if missing:
            raise KeyError(f"params lack {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        return jax.tree.unflatten(self.treedef, [params[n] for n in self.names])


def _path_name(path: tuple) -> str:
    """("blocks", 0, "attn", "q", "kernel", .value) -> "blocks/0/attn/q/kernel"."""
    parts = []
    for key in path:
        if isinstance(key, DictKey):
            parts.append(str(key.key))
        elif isinstance(key, GetAttrKey) and key.name == "value":
            continue  # the Variable's payload, not part of the parameter's name
        else:
            raise ValueError(f"unexpected pytree key {key!r} in model state")
    return "/".join(parts)


def _flatten(state: nnx.State) -> tuple[FlatParams, jax.tree_util.PyTreeDef, tuple[str, ...]]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = tuple(_path_name(path) for path, _ in leaves)
    return dict(zip(names, (leaf for _, leaf in leaves), strict=True)), treedef, names


def _only_params(module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    graphdef, state = nnx.split(module, nnx.Param)
    return graphdef, state


def build_module(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The module of `cfg.family`: the decoder (`Transformer`) or the `VisionTransformer`."""
    if cfg.family == "vit":
        from diloco_core.vit import VisionTransformer  # vit builds on this module's blocks

        return VisionTransformer(cfg, rngs=rngs)
    return Transformer(cfg, rngs=rngs)


def make_model_def(cfg: ModelConfig) -> ModelDef:
    """The ModelDef for `cfg`, built abstractly (no parameter memory is allocated)."""
    abstract = nnx.eval_shape(lambda: build_module(cfg, nnx.Rngs(0)))
    graphdef, state = _only_params(abstract)
    _, treedef, names = _flatten(state)
    return ModelDef(cfg=cfg, graphdef=graphdef, treedef=treedef, names=names)


def init_model(cfg: ModelConfig, seed: int) -> tuple[ModelDef, FlatParams]:
    """Build the model with freshly initialised float32 params; deterministic for a seed."""
    graphdef, state = _only_params(build_module(cfg, nnx.Rngs(seed)))
    params, treedef, names = _flatten(state)
    return ModelDef(cfg=cfg, graphdef=graphdef, treedef=treedef, names=names), params


def apply_model_with_aux(model_def: ModelDef, params: FlatParams, inputs: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
    """(logits, the MoE blocks' mean load-balancing loss, 0 for dense models). Decoder: tokens
    int32 [B, L] -> [B, L, V]; vit: images float32 [B, H, W] -> [B, classes]. Jittable (merges
    the module inside)."""
    model = nnx.merge(model_def.graphdef, model_def.to_state(params))
    return model(inputs)


def apply_model(model_def: ModelDef, params: FlatParams, inputs: jax.Array) -> jax.Array:
    """Logits only (see `apply_model_with_aux`)."""
    return apply_model_with_aux(model_def, params, inputs)[0]


def abstract_params(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of every parameter, via `jax.eval_shape`: nothing is allocated."""
    return dict(_abstract_params(cfg))


@functools.lru_cache(maxsize=32)
def _abstract_params(cfg: ModelConfig) -> tuple[tuple[str, jax.ShapeDtypeStruct], ...]:
    # Tracing all N blocks costs O(N^2) here (NNX inspects every traced RNG-counter update
    # against the whole growing jaxpr), ~3 s for "12b". The blocks are identical, so trace a
    # one-block model and repeat block 0's shapes; tests check this against a real full init.
    one_block = dataclasses.replace(cfg, n_layers=1)

    def build() -> FlatParams:
        return _flatten(_only_params(build_module(one_block, nnx.Rngs(0)))[1])[0]

    shapes = jax.eval_shape(build)
    out: dict[str, jax.ShapeDtypeStruct] = {}
    for name, shape in shapes.items():
        if name.startswith("blocks/0/"):
            for i in range(cfg.n_layers):
                out[f"blocks/{i}/{name.removeprefix('blocks/0/')}"] = shape
        else:
            out[name] = shape
    return tuple(sorted(out.items()))


def param_count(cfg: ModelConfig) -> int:
    return sum(int(np.prod(s.shape)) for s in abstract_params(cfg).values())


def param_bytes(cfg: ModelConfig, bytes_per_value: float = 4) -> int:
    """Bytes to hold all params at `bytes_per_value` each (4 = fp32, 2 = bf16, 0.5 = int4)."""
    return int(param_count(cfg) * bytes_per_value)


def is_embedding(name: str) -> bool:
    """True for the token embedding table and the output projection (merged by weighted mean)."""
    return name in EMBEDDING_NAMES


def is_norm_scale(name: str) -> bool:
    """True for RMSNorm scales (excluded from weight decay)."""
    return name.endswith("norm/scale")
