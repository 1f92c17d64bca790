"""Each learner's inner optimizer: AdamW with warmup + constant / WSD / cosine schedule and
clipping."""

import optax

from diloco_core.config import InnerOptConfig
from diloco_core.model import FlatParams, is_norm_scale


def build_schedule(cfg: InnerOptConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup 0 -> cfg.lr over warmup_steps, then constant, WSD or cosine.

    The horizon (cfg.decay_steps, or total_steps when 0) counts from step 0 and includes the
    warmup, as in `optax.warmup_cosine_decay_schedule`; past it the lr stays at the floor
    (lr * min_lr_ratio). "wsd" (warmup-stable-decay) holds the peak until the horizon's last
    `wsd_decay_fraction` and decays linearly to the floor over it; "cosine" decays from the
    warmup's end.
    """
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    if cfg.schedule == "constant":
        return optax.join_schedules([warmup, optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])
    # optax needs a non-empty decay phase; a budget shorter than the warmup gets one step of it.
    decay_steps = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
    if cfg.schedule == "wsd":
        decay_from = max(cfg.warmup_steps,
                         decay_steps - max(1, round(cfg.wsd_decay_fraction * decay_steps)))
        decay = optax.linear_schedule(cfg.lr, cfg.lr * cfg.min_lr_ratio, decay_steps - decay_from)
        return optax.join_schedules([warmup, optax.constant_schedule(cfg.lr), decay],
                                    [cfg.warmup_steps, decay_from])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps, end_value=cfg.lr * cfg.min_lr_ratio)


def weight_decay_mask(params: FlatParams) -> dict[str, bool]:
    """True where weight decay applies: everything but RMSNorm scales (decaying them to 0 would
    pull normalised activations towards 0 rather than regularise)."""
    return {name: not is_norm_scale(name) for name in params}


def build_inner_optimizer(cfg: InnerOptConfig, total_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm (if clip_norm > 0) then AdamW with the schedule and the decay mask."""
    adamw = optax.adamw(learning_rate=build_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                        eps=cfg.eps, weight_decay=cfg.weight_decay, mask=weight_decay_mask)
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw


def lr_at(cfg: InnerOptConfig, total_steps: int, step: int) -> float:
    """The learning rate applied at inner step `step` (0-based)."""
    return float(build_schedule(cfg, total_steps)(step))
