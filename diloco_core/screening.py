"""Screening outer gradients for absurd norms before they are merged.

A contribution whose outer gradient is far larger than the others' is almost always a bug or a
fault (a diverged learner, a corrupt payload that still decodes, a wrong scale), and one such
contribution can wreck the global model. RDA already averages directions, but the weighted mean
of embeddings and the merged norm still see it.

Learners contribute different amounts of progress (a learner that just rejoined has a few
steps, a fast one hundreds), and the norm grows with the steps taken, so the comparison is per
inner step: an AdamW step moves each value by about the learning rate whatever the data, so
norm / steps is comparable across learners. With at least three contributions, one whose
per-step norm exceeds `max_ratio` times the median of the *others* is excluded, with the ratio
as the reason. Two contributions cannot say which one is wrong among themselves; then (and
for one) the reference is the previous merge of the same fragment, when there is one: its
members' median per-step norm. A round of two, one of them absurd, must not wreck the model.
"""

import math
import statistics
from collections.abc import Sequence


def screen_norms(learners: Sequence[str], norms: Sequence[float], steps: Sequence[int],
                 max_ratio: float, reference: float | None = None) -> dict[str, str]:
    """Learners whose outer-gradient norm per inner step is an outlier, mapped to the reason.
    `reference`: the previous merge's median per-step norm (used below three contributions)."""
    if not len(learners) == len(norms) == len(steps):
        raise ValueError(f"{len(learners)} learners, {len(norms)} norms, {len(steps)} steps")
    if math.isinf(max_ratio):
        return {}
    per_step = [n / max(s, 1) for n, s in zip(norms, steps, strict=True)]
    if len(norms) < 3:
        if not reference or reference <= 0:
            return {}
        return {name: (f"outer-gradient norm per step {x:.4g} is {x / reference:.1f}x the "
                       f"previous merge's median ({reference:.4g}); limit {max_ratio:g}x")
                for name, x in zip(learners, per_step, strict=True)
                if x > max_ratio * reference}
    flagged = {}
    for i, name in enumerate(learners):
        others = statistics.median(n for j, n in enumerate(per_step) if j != i)
        if others > 0 and per_step[i] > max_ratio * others:
            flagged[name] = (f"outer-gradient norm per step {per_step[i]:.4g} is "
                             f"{per_step[i] / others:.1f}x the median of the others "
                             f"({others:.4g}); limit {max_ratio:g}x")
    return flagged
