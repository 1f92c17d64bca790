"""Merge weights: how much each admitted learner counts in a merge.

Token weighting (Decoupled DiLoCo, Sec. 3.2) is "quantity x quality": w = tokens * (tokens/steps)
= tokens^2 / steps, with tokens and steps counted since the learner last received the fragment.
A learner that trained longer (more tokens) or with larger batches (more tokens per step) counts
more. Zero steps means nothing to contribute and gives weight 0 (never a division by zero).
"""

from collections.abc import Sequence

import numpy as np


def merge_weight(tokens: float, steps: float) -> float:
    """w = tokens^2 / steps; 0 when steps is 0."""
    if tokens < 0 or steps < 0:
        raise ValueError(f"tokens and steps must be >= 0, got tokens={tokens}, steps={steps}")
    return float(tokens) ** 2 / float(steps) if steps > 0 else 0.0


def normalized_weights(tokens: Sequence[float], steps: Sequence[float],
                       weighting: str = "tokens") -> np.ndarray:
    """Weights summing to 1 over the admitted learners ("tokens" or "uniform")."""
    if len(tokens) != len(steps):
        raise ValueError(f"{len(tokens)} token counts but {len(steps)} step counts")
    if weighting == "tokens":
        raw = np.array([merge_weight(t, s) for t, s in zip(tokens, steps, strict=True)])
    elif weighting == "uniform":
        raw = np.array([1.0 if s > 0 else 0.0 for s in steps])
    else:
        raise ValueError(f"unknown weighting {weighting!r}")
    total = raw.sum()
    if not total > 0:
        raise ValueError("all merge weights are zero: no admitted learner took a step")
    return raw / total
