"""Screening outer gradients for absurd norms before they are merged.

A contribution whose outer-gradient norm is far above the others' is almost always a bug or a
fault (a diverged learner, a corrupt payload that still decodes, a wrong scale), and one such
contribution can wreck the global model. RDA already averages directions, but the weighted mean
of embeddings and the merged norm still see it. With at least three contributions, one whose
norm exceeds `max_ratio` times the median of the *others* is excluded, with the ratio as the
reason. Two contributions cannot say which one is wrong, so nothing is screened then.
"""

import math
import statistics
from collections.abc import Sequence


def screen_norms(learners: Sequence[str], norms: Sequence[float], max_ratio: float
                 ) -> dict[str, str]:
    """Learners whose outer-gradient norm is an outlier, mapped to the reason."""
    if len(learners) != len(norms):
        raise ValueError(f"{len(learners)} learners but {len(norms)} norms")
    if len(norms) < 3 or math.isinf(max_ratio):
        return {}
    flagged = {}
    for i, (name, norm) in enumerate(zip(learners, norms, strict=True)):
        others = statistics.median(n for j, n in enumerate(norms) if j != i)
        if others > 0 and norm > max_ratio * others:
            flagged[name] = (f"outer-gradient norm {norm:.4g} is {norm / others:.1f}x the median "
                             f"of the others ({others:.4g}); limit {max_ratio:g}x")
    return flagged
