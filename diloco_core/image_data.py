"""Labelled images for the "digits" task: a seeded split into disjoint learner shards and a
held-out set, and a resumable, per-epoch shuffled batch iterator (the image counterpart of
`data.BatchIterator`). Pure NumPy: loading the data set is `resources/digits.py`'s job.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from diloco_core.data import ShuffledBatches


@dataclass(frozen=True)
class Examples:
    """images float32 [N, H, W] in [0, 1], labels int32 [N]."""

    images: np.ndarray
    labels: np.ndarray

    def __post_init__(self):
        if self.images.ndim != 3 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"images must be [N, H, W] and labels [N], got "
                             f"{self.images.shape} and {self.labels.shape}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def take(self, rows: np.ndarray) -> "Examples":
        return Examples(self.images[rows], self.labels[rows])

    def as_batch(self) -> dict[str, np.ndarray]:
        return {"images": self.images.astype(np.float32), "labels": self.labels.astype(np.int32)}


def split_examples(examples: Examples, num_learners: int, heldout_fraction: float, seed: int
                   ) -> tuple[list[Examples], Examples]:
    """(M disjoint learner shards, held-out set): one seeded permutation; the first
    round(heldout_fraction * N) examples are held out, the rest dealt into M near-equal shards.
    Every example lands in exactly one of them."""
    n = len(examples)
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    order = np.random.Generator(np.random.PCG64([seed, 7919])).permutation(n)
    held = max(1, round(heldout_fraction * n))
    shards = np.array_split(order[held:], num_learners)
    if min(len(s) for s in shards) == 0:
        raise ValueError(f"{n - held} training examples cannot fill {num_learners} shards")
    return [examples.take(np.sort(s)) for s in shards], examples.take(np.sort(order[:held]))


class ExampleIterator(ShuffledBatches):
    """Endless batches {"images", "labels"} of one shard, reshuffled every epoch and resumable
    from `state()` bit for bit, like the text iterator (`data.ShuffledBatches`)."""

    def __init__(self, examples: Examples, batch_size: int, seed: int = 0,
                 state: Mapping[str, int] | None = None):
        if batch_size < 1 or batch_size > len(examples):
            raise ValueError(f"batch_size must be in [1, {len(examples)}] (the shard's size), "
                             f"got {batch_size}")
        self.examples = examples
        super().__init__(len(examples), batch_size, seed, state)

    def next(self) -> dict[str, np.ndarray]:
        return self.examples.take(self._next_rows()).as_batch()
