"""scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes; shipped inside the package,
no download), as `Examples` with grey levels scaled from 0..16 to [0, 1]."""

import numpy as np

from diloco_core.image_data import Examples, split_examples


def load_digits_examples() -> Examples:
    from resources.extras import require_extra

    require_extra("digits", "the digits task", ("sklearn",))
    from sklearn.datasets import load_digits  # heavy import, only for the digits task

    data = load_digits()
    return Examples(images=(data.images / 16.0).astype(np.float32),
                    labels=data.target.astype(np.int32))


def digits_splits(num_learners: int, heldout_fraction: float, seed: int
                  ) -> tuple[list[Examples], Examples]:
    """The M disjoint learner shards and the held-out set of the digits task."""
    return split_examples(load_digits_examples(), num_learners, heldout_fraction, seed)
