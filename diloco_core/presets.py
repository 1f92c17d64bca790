"""Model shape presets.

`tiny` is for tests (seconds on CPU), `small` for demos and benchmarks on 2 CPU cores; the `moe-`
presets are their mixture-of-experts counterparts, `vit-` the vision transformers of the digits
task. The
paper-scale shapes (Gemma-like widths, a 262k vocabulary, untied embeddings) are only ever built
abstractly with `jax.eval_shape`, to count parameters and bytes for planning.
"""

MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128),
    "small": dict(vocab_size=256, d_model=128, n_layers=6, n_heads=4, d_ff=512, max_seq_len=256),
    # Mixture of experts: 8 experts of width 128 per block, top-2 routing. Per token the active
    # MLP width (2 x 128) is half the dense "small" one; the total is twice it.
    "moe-tiny": dict(vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_ff=32,
                     max_seq_len=128, n_experts=4, experts_per_token=2),
    "moe-small": dict(vocab_size=256, d_model=128, n_layers=6, n_heads=4, d_ff=128,
                      max_seq_len=256, n_experts=8, experts_per_token=2),
    # Vision transformer for the 8x8 digits: 2x2 patches (16 per image), mean-pooled.
    "vit-digits": dict(family="vit", d_model=64, n_layers=4, n_heads=4, d_ff=128,
                       max_seq_len=16, patch_size=2),
    "vit-moe-digits": dict(family="vit", d_model=64, n_layers=4, n_heads=4, d_ff=64,
                           max_seq_len=16, patch_size=2, n_experts=4, experts_per_token=2),
    "2b": dict(vocab_size=262_144, d_model=2048, n_layers=18, n_heads=8, d_ff=8192,
               max_seq_len=8192),
    "5b": dict(vocab_size=262_144, d_model=3072, n_layers=24, n_heads=16, d_ff=12288,
               max_seq_len=8192),
    "9b": dict(vocab_size=262_144, d_model=3584, n_layers=34, n_heads=16, d_ff=14336,
               max_seq_len=8192),
    "12b": dict(vocab_size=262_144, d_model=3840, n_layers=44, n_heads=16, d_ff=15360,
                max_seq_len=8192),
}

PAPER_SCALE_PRESETS = ("2b", "5b", "9b", "12b")
