"""Scoring an arm's final model on the validation and test slices (`diloco_core.eval_slices`).

Every quality result carries both slices' mean loss, its standard error over batches and the
number of batches (plus each batch's loss, so two arms can be compared batch by batch), next to
the simulator's own first-8 KB figure, which is kept only as a continuity column. At 100 + 100
batches of the `small` model this takes a few seconds on 2 CPU cores, against minutes of
training.
"""

import math
import statistics
from dataclasses import dataclass

# Each slice >= 100 batches (issue 38): at 16 x 128 tokens that is 400 KB of the 1.8 MB held-out
# stream per slice, and a standard error over batches of a few thousandths of a nat.
VALIDATION_BATCHES = 100
TEST_BATCHES = 100


@dataclass(frozen=True)
class SliceSizes:
    validation: int = VALIDATION_BATCHES
    test: int = TEST_BATCHES


DEFAULT_SIZES = SliceSizes()


def mean_and_standard_error(values) -> tuple[float, float | None]:
    """The mean and its standard error (sample standard deviation / sqrt(n)); None for n = 1."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return mean, None
    return mean, statistics.stdev(values) / math.sqrt(len(values))


def slice_figures(losses) -> dict:
    """One slice's figures from its per-batch losses."""
    mean, se = mean_and_standard_error(losses)
    return {"loss": mean, "standard_error": se, "batches": len(losses),
            "batch_losses": [round(float(x), 5) for x in losses]}


def score_slices(cfg, params, heldout_stream, sizes: SliceSizes) -> dict | None:
    """Both slices' figures for a text arm; None for the digits task (its held-out set is 360
    images, scored whole by the simulator)."""
    if cfg.task == "digits":
        return None
    from diloco_core.eval_slices import TEST, VALIDATION, heldout_slices
    from diloco_core.evaluation import batch_losses
    from diloco_core.model import make_model_def

    model_def = make_model_def(cfg.model)
    slices = heldout_slices(heldout_stream, cfg.data.batch_size, cfg.data.seq_len,
                            sizes.validation, sizes.test)
    return {"batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
            "selection": "evenly spaced disjoint windows over the whole held-out stream, "
                         "alternating validation / test (diloco_core/eval_slices.py)",
            **{name: slice_figures(batch_losses(model_def, params, slices[name]))
               for name in (VALIDATION, TEST)}}


def sizes_of(record: dict) -> SliceSizes | None:
    """The slice sizes a stored result was scored with (None: scored before the slices)."""
    slices = record.get("heldout_slices")
    if not slices:
        return None
    return SliceSizes(slices["validation"]["batches"], slices["test"]["batches"])
