"""Scoring an orchestrated run's final global model on the held-out test slice, as the quality
benchmarks score a simulated arm (`scoring.score_slices`), and comparing two runs batch by batch.

The run summary's `final_eval_loss` is the syncer's own eval: the first few batches of the
held-out stream (512 tokens in the soaks), whose sampling error is several percent, larger than
the differences the soaks judge. Here the final parameters are read from the run's store (every
fragment at its current version, `pipelines.round_eval.global_params`, the reader the syncer's
eval uses), the held-out stream is the one the run's config names (loaded as the quality runner
loads it), and the model is scored on the test slice (`diloco_core.eval_slices`, 100 batches of
the run's batch shape spread over the whole stream by default): mean loss, its standard error
over batches and each batch's loss. Two runs of one config are scored on the same batches, so
their paired difference (`paired_difference`) cancels the batches' own difficulty and says
whether a gap between them is more than the text's noise.
"""

from benchmarks.quality.scoring import (
    DEFAULT_SIZES,
    SliceSizes,
    mean_and_standard_error,
    score_slices,
)
from benchmarks.quality.slice_report import ratio_se_over_batches
from diloco_core.eval_slices import TEST


def score_store(store, sizes: SliceSizes = DEFAULT_SIZES) -> dict:
    """The test-slice figures of the global model in `store` (an `ArtifactStore` opened on the
    run's experiment): {"loss", "standard_error", "batches", "batch_losses", "batch_size",
    "seq_len", "versions"}."""
    from benchmarks.quality.runner import _data
    from pipelines.round_eval import global_params

    cfg, params, versions = global_params(store)
    slices = score_slices(cfg, params, _data(cfg).heldout_stream, sizes)
    if slices is None:
        raise ValueError(f"experiment {store.experiment!r} is not a text task: no test slice")
    return {**slices[TEST], "batch_size": slices["batch_size"], "seq_len": slices["seq_len"],
            "versions": versions}


def paired_difference(a: list[float], b: list[float]) -> dict:
    """Run `a` against run `b`, scored on the same batches, batch by batch: the mean of a - b
    and its standard error over batches, and the ratio of their mean losses with the ratio's
    own standard error over batches (`slice_report.ratio_se_over_batches`, as the quality
    reports compare two arms). A hard batch is hard for both runs, so both errors are much
    smaller than either loss's own."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"paired scores need the same 2+ batches: {len(a)} against {len(b)}")
    mean, se = mean_and_standard_error([float(x) - float(y) for x, y in zip(a, b, strict=True)])
    ratio_se = ratio_se_over_batches({0: {"heldout_slices": {TEST: {"batch_losses": list(a)}}}},
                                     {0: {"heldout_slices": {TEST: {"batch_losses": list(b)}}}},
                                     TEST)
    return {"mean": mean, "standard_error": se, "ratio": sum(a) / sum(b),
            "ratio_standard_error": ratio_se, "batches": len(a)}
