"""A run's data, whatever its task: each learner's shard and the held-out set, with a one-line
description. Text reads the corpus (`corpus.py`); digits loads scikit-learn's images
(`digits.py`)."""

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
