"""Learners that use a store as real ones do, without training (the control-plane benchmarks).

Each writes heartbeats with the progress a learner would report and offers a prepared
contribution of its fragment: one random delta per learner and fragment, encoded once, with
its scales nudged by the round so that no two offers carry the same bytes (the syncer refuses
a copy). The counters they claim are consistent with their heartbeats, as an honest learner's.
"""

import time

import numpy as np

from diloco_core.compression import Encoded, encode
from diloco_core.contribution import Contribution


class SyntheticLearners:
    def __init__(self, store, cfg, scale_step: float = 1e-4):
        self.store, self.names = store, list(cfg.learners.learner_names)
        self.P = cfg.sync.num_fragments
        self.steps = cfg.sync.sync_period // self.P or 1      # inner steps between offers
        self.per_step = cfg.tokens_per_learner_step
        self.scale_step = scale_step
        rng = np.random.default_rng(0)
        self.prepared = {
            (n, p): {k: encode(rng.standard_normal(v.shape).astype(np.float32) * 1e-3,
                               cfg.sync.encoding, cfg.sync.encoding_block_size)
                     for k, v in store.load_global(p).params.items()}
            for p in range(self.P) for n in self.names}
        self.beats = dict.fromkeys(self.names, 0)

    def advance(self) -> None:
        """Every learner makes the steps of one offer."""
        for n in self.names:
            self.beats[n] += self.steps

    def beat(self, n: str) -> None:
        self.store.put_heartbeat(n, {
            "learner": n, "status": "training", "time": time.time(), "attempt": 0,
            "step": self.beats[n], "tokens_total": self.beats[n] * self.per_step,
            "compute_seconds": 0.01 * max(1, self.beats[n]), "training_seconds": 1.0})

    def offer(self, n: str, r: int, version: int) -> None:
        p = r % self.P
        delta = {k: Encoded(e.encoding, e.shape, e.block_size, np.asarray(e.payload),
                            np.asarray(e.scales) * np.float32(1 + self.scale_step * (r + 1)))
                 for k, e in self.prepared[n, p].items()}
        self.store.put_contribution(Contribution(
            n, p, r, version, self.steps * self.per_step, self.steps, self.beats[n],
            time.time(), delta), {"train_loss": 3.0})
