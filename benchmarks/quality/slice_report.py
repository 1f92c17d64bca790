"""A group of runs (one configuration, several seeds) summarised on the validation and test
slices: the mean over seeds, and two standard errors, since they answer different questions.

- over batches: how much the figure would move on other text (the slices' sampling error),
  sqrt(sum of each run's squared standard error) / n for the mean of n runs;
- over seeds: how much it would move with another training seed, stdev of the runs' means /
  sqrt(n) (None for one seed).

Runs scored before the slices existed have no slice figures: a group with any such run reports
None rather than a mean over fewer seeds than it says.
"""

import math

from benchmarks.quality.scoring import mean_and_standard_error


def slice_loss(record: dict, name: str) -> float | None:
    """One run's mean loss on slice `name` ("validation" or "test"), None if not scored."""
    slices = record.get("heldout_slices")
    return slices[name]["loss"] if slices else None


def across_seeds(records: list[dict], name: str) -> dict | None:
    """{"loss", "se_batches", "se_seeds", "batches", "runs"} over the runs, or None."""
    figures = [(r.get("heldout_slices") or {}).get(name) for r in records]
    if not records or any(f is None for f in figures):
        return None
    mean, se_seeds = mean_and_standard_error([f["loss"] for f in figures])
    batch_errors = [f["standard_error"] for f in figures]
    se_batches = (None if any(e is None for e in batch_errors)
                  else math.sqrt(sum(e * e for e in batch_errors)) / len(figures))
    return {"loss": mean, "se_batches": se_batches, "se_seeds": se_seeds,
            "batches": figures[0]["batches"], "runs": len(figures)}


def paired_ratios(records: dict[int, dict], reference: dict[int, dict], name: str
                  ) -> list[float]:
    """Per seed, loss on slice `name` over the reference's at the same seed (seeds where both
    were scored on the slices)."""
    out = []
    for seed, record in sorted(records.items()):
        ref = reference.get(seed)
        mine, theirs = slice_loss(record, name), ref and slice_loss(ref, name)
        if mine is not None and theirs:
            out.append(mine / theirs)
    return out


def ratio_se_over_batches(records: dict[int, dict], reference: dict[int, dict], name: str
                          ) -> float | None:
    """The standard error over batches of the mean paired ratio (`paired_ratios`), the two arms
    compared batch by batch on the same text: per seed, the ratio estimator's error
    stdev(a_b - r * ref_b) / sqrt(n) / mean(ref), then sqrt(sum of squares) / seeds. Much
    smaller than either loss's own error over batches, since a hard batch is hard for both.
    None where a seed lacks per-batch losses."""
    errors = []
    for seed, record in sorted(records.items()):
        ref = reference.get(seed)
        mine = (record.get("heldout_slices") or {}).get(name)
        theirs = ref and (ref.get("heldout_slices") or {}).get(name)
        if not mine or not theirs:
            continue
        a, b = mine.get("batch_losses"), theirs.get("batch_losses")
        if not a or not b or len(a) != len(b) or len(a) < 2:
            return None
        ratio = sum(a) / sum(b)
        residuals = [x - ratio * y for x, y in zip(a, b, strict=True)]
        errors.append(mean_and_standard_error(residuals)[1] / (sum(b) / len(b)))
    return math.sqrt(sum(e * e for e in errors)) / len(errors) if errors else None
