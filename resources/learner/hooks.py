"""Where a driver may step into a learner's loop: the chaos harness's only way in.

The learner's own behaviour is the no-op below. A chaos run's learner entry passes the fault
tape's injectors instead (`resources.chaos.faults.LearnerFaults`, a subclass), so the runtime
never imports fault injection.
"""

import time
from collections.abc import Callable

from diloco_core.contribution import Contribution
from resources.store.artifact_store import ArtifactStore

# Runs once the offer's payload is written (a chaos run tampers with it there).
AfterPut = Callable[[ArtifactStore], None]


class LearnerHooks:
    def wrap_store(self, store: ArtifactStore) -> ArtifactStore:
        """The store as this learner sees it."""
        return store

    def clock(self) -> float:
        """This learner's idea of the time (what its records say)."""
        return time.time()

    def before_step(self, step: int, flush_record: Callable[[str], None]) -> None:
        """Called before each inner step; `flush_record(status)` writes the final record."""

    def slowdown(self, step: int) -> float:
        """How many times slower than its configured speed this step runs."""
        return 1.0

    def offer(self, contribution: Contribution, round_index: int
              ) -> tuple[Contribution, AfterPut | None, dict]:
        """The contribution to write for an offer to `round_index`, what to run once it is
        written, and what to add to the offer's `extra` record."""
        return contribution, None, {}
