"""A learner of the reference simulator: its model and data, its side of the round protocol,
and the time it spends stepping, waiting, down or absent."""

from dataclasses import dataclass, field

import numpy as np

from diloco_core.data import BatchIterator
from diloco_core.inner_step import TrainState
from diloco_core.learner import LearnerSync
from diloco_core.simulated_syncer import LearnerView
from diloco_core.simulation_result import LearnerStats


@dataclass
class Since:
    """When a learner's current stretch of each kind began (None: not in one)."""

    step: float | None = None        # a step is in progress (at most one per learner)
    blocked: float | None = None     # up, held by pacing
    down: float | None = None        # failed, not back yet
    absent: float | None = None      # scavenged capacity: not part of the run now
    closing: float | None = None     # up after STOP, answering the final rounds


@dataclass
class SimulatedLearner:
    """One simulated learner: its training state, where it is in the round protocol, and
    what its heartbeat would tell the syncer (`view`)."""

    index: int
    name: str
    speed: float
    rng: np.random.Generator
    train: TrainState
    sync: LearnerSync
    data: BatchIterator
    stats: LearnerStats
    up: bool = True
    generation: int = 0                      # bumps on failure: stale step events are ignored
    tokens_at_round_seen: int = 0            # its tokens when it saw the newest round open
    since: Since = field(default_factory=Since)
    offered: dict[int, int] = field(default_factory=dict)   # round -> learner step of the offer
    declined: list[int] = field(default_factory=list)       # rounds it declined (heartbeat)
    inbox: list[tuple[int, int, dict]] = field(default_factory=list)  # (round, version, values)
    losses: list = field(default_factory=list)
    rejoined_at: float | None = None
    down_at: float | None = None
    left: bool = False                       # its capacity was reclaimed for good
    joined: bool = True                      # scavenged capacity: here yet

    def view(self, stopping: bool) -> LearnerView:
        if not self.joined:
            status = "absent"
        elif self.left:
            status = "left"
        elif not self.up:
            status = "failed"
        else:
            status = "stopping" if stopping else "training"
        return LearnerView(self.name, status, self.generation, self.stats.steps,
                           self.stats.tokens, self.stats.busy_seconds, tuple(self.declined))
