"""A run's data, whatever its task: each learner's shard and the held-out set, with a one-line
description. Text reads the corpus (`corpus.py`); digits loads scikit-learn's images
(`digits.py`)."""

import functools
from dataclasses import dataclass

import numpy as np

from diloco_core.config import ExperimentConfig
from diloco_core.image_data import Examples


@dataclass(frozen=True)
class TaskData:
    learner_streams: list[np.ndarray] | list[Examples]   # one shard per learner, disjoint
    heldout_stream: np.ndarray | Examples
    description: str


def load_task_data(cfg: ExperimentConfig) -> TaskData:
    m, heldout = cfg.learners.num_learners, cfg.data.heldout_fraction
    if cfg.task == "digits":
        from resources.digits import digits_splits

        shards, held = digits_splits(m, heldout, cfg.seed)
        sizes = ", ".join(str(len(s)) for s in shards)
        return TaskData(shards, held, f"scikit-learn digits: {sizes} training images per "
                                      f"learner, {len(held)} held out")
    from resources.corpus import load_corpus

    corpus = load_corpus(cfg.data.corpus, m, heldout)
    return TaskData(corpus.learner_streams, corpus.heldout_stream,
                    f"corpus {cfg.data.corpus!r}: {corpus.summary()}")


@functools.lru_cache(maxsize=4)
def heldout_text_batches(cfg: ExperimentConfig, num_batches: int) -> np.ndarray:
    """The first `num_batches` held-out batches of a text run, int32 [N, B, L]: the same ones
    for every evaluation of one config (round evals, the run summary, an exported model)."""
    from diloco_core.data import heldout_batches
    from resources.corpus import load_corpus

    corpus = load_corpus(cfg.data.corpus, cfg.learners.num_learners, cfg.data.heldout_fraction)
    return heldout_batches(corpus.heldout_stream, cfg.data.batch_size, cfg.data.seq_len,
                           num_batches)
