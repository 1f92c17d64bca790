"""Each learner's own shard of the training data and the held-out data a run is scored on, for
any task (token streams for text, labelled images for the digits task): shared by the
simulator, its baselines and the learner process, so that all of them read the same batches."""

import numpy as np

from diloco_core.config import ExperimentConfig
from diloco_core.data import BatchIterator, heldout_batches
from diloco_core.image_data import ExampleIterator, Examples


def learner_data(cfg: ExperimentConfig, index: int, stream: np.ndarray | Examples
                 ) -> BatchIterator | ExampleIterator:
    """Learner `index`'s batches: its own shard (a token stream, or labelled images for the
    digits task), its own seeded order (shared with baselines)."""
    seed = cfg.seed * 1000 + index
    if cfg.task == "digits":
        return ExampleIterator(stream, cfg.learner_batch_sizes[index], seed=seed)
    return BatchIterator(stream, cfg.learner_batch_sizes[index], cfg.data.seq_len, seed=seed)


def heldout_data(cfg: ExperimentConfig, heldout: np.ndarray | Examples):
    """What `evaluation.evaluate` scores: eval_batches batches of text, or every held-out
    image."""
    if cfg.task == "digits":
        return heldout.as_batch()
    return heldout_batches(heldout, cfg.data.batch_size, cfg.data.seq_len,
                           cfg.simulation.eval_batches)
