"""A small vision transformer classifier (the "digits" task): images -> class logits.

Each H x W grey image is cut into square patches of `patch_size` pixels, linearly embedded,
given a learned position embedding, and run through the same pre-norm blocks as the language
model (bidirectional attention, dense or mixture-of-experts MLPs); the final-normed tokens are
mean-pooled into a linear classifier. For the 8x8 digits with 2x2 patches that is 16 tokens.

Parameter names: `patch_embed/kernel`, `pos_embed`, `blocks/i/...` as in the decoder,
`final_norm/scale`, `head/kernel`. None is an "embedding" in the merge rule's sense (no rows
that only some learners' data touch), so every tensor merges by RDA.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from diloco_core.config import DIGITS_CLASSES, ModelConfig
from diloco_core.model import Block, _linear, _rms_norm, run_blocks


def patchify(images: jax.Array, patch: int) -> jax.Array:
    """images [B, H, W] -> patches [B, (H/p) * (W/p), p * p], row-major over the patch grid."""
    b, h, w = images.shape
    grid = images.reshape(b, h // patch, patch, w // patch, patch)
    return grid.transpose(0, 1, 3, 2, 4).reshape(b, (h // patch) * (w // patch), patch * patch)


class VisionTransformer(nnx.Module):
    """images float32 [B, H, W] (values in [0, 1]) -> logits float32 [B, classes]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, num_classes: int = DIGITS_CLASSES):
        self.patch = cfg.patch_size
        self.max_patches = cfg.max_seq_len
        self.patch_embed = _linear(cfg.patch_size ** 2, cfg.d_model, cfg, rngs)
        self.pos_embed = nnx.Param(
            nnx.initializers.normal(stddev=0.02)(rngs.params(), (cfg.max_seq_len, cfg.d_model),
                                                 jnp.float32))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = _rms_norm(cfg, rngs)
        # Zero-initialised head: the untrained model predicts the uniform distribution.
        self.head = _linear(cfg.d_model, num_classes, cfg, rngs,
                            kernel_init=nnx.initializers.zeros_init())

    def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(logits [B, classes], mean load-balancing loss of the MoE blocks or 0)."""
        patches = patchify(images.astype(jnp.float32), self.patch)
        n = patches.shape[1]
        if n > self.max_patches:
            raise ValueError(f"{n} patches per image exceed max_seq_len {self.max_patches}")
        x = self.patch_embed(patches) + self.pos_embed[...][None, :n]
        x, aux = run_blocks(self.blocks, x)
        pooled = jnp.mean(self.final_norm(x), axis=1)
        return self.head(pooled).astype(jnp.float32), aux
