"""What one learner process reports of itself: its heartbeat (what the syncer and the supervisor
read: status, step, tokens, versions, offers, clocks), its attempt record (its token ledger) and
its progress line in the log. `ProcessProgress` holds what the process reports beyond its
protocol state: its status, where it started from, its clocks and its counters."""

import dataclasses
import os
import time
from typing import TYPE_CHECKING

from diloco_core.round_records import RoundOpen

if TYPE_CHECKING:
    from resources.learner.runtime import LearnerRuntime


@dataclasses.dataclass
class ProcessProgress:
    # "training", then "stopping" / "leaving" once stop is seen, and at the end "done", "left",
    # "failed" or "superseded" (the status the syncer and the supervisor read).
    status: str = "starting"
    rejoined_from: str | None = None       # "own: ...", "peer: ..." or "fresh: ..." (the restore)
    started_at: float = dataclasses.field(default_factory=time.time)
    compute_seconds: float = 0.0           # inner steps, their padding and slowdown included
    steps: int = 0                         # inner steps taken by this process (not restored)
    loop_started: float | None = None      # time.monotonic() when the loop began
    training_seconds: float | None = None  # set when training stops
    last_loss: float | None = None
    checkpoint_step: int | None = None     # the newest durable checkpoint

    def wall_seconds(self) -> float:
        return time.time() - self.started_at

    def training_so_far(self) -> float:
        """Seconds of the loop spent training: until stop was seen, or until now."""
        if self.training_seconds is not None:
            return self.training_seconds
        return 0.0 if self.loop_started is None else time.monotonic() - self.loop_started


def ready_beat_due(open_round: RoundOpen | None, learner: str, tokens_total: int, needed: int,
                   beaten_for: int | None) -> int | None:
    """The round this learner's progress has just made it ready to follow, when its heartbeat
    should go out now rather than at the next interval; None when no beat is due.

    The syncer opens the next round once K learners' heartbeats show the tokens of H/P of their
    steps since the latest round opened (`round_protocol.ready_to_open`, against the totals
    that round recorded when it opened, `RoundOpen.learner_tokens`). A beat every
    `heartbeat_seconds` told it late, by half an interval on average, and every round opened
    that much later: the demo merged 52 rounds where the simulator at its measured clock,
    which opens on the step, merged 66. One extra beat a round per learner (`beaten_for`: the
    round it last beat for, -1 before round 0) tells it at the link's next write (within a
    poll interval) instead."""
    key = -1 if open_round is None else open_round.round
    if beaten_for is not None and beaten_for >= key:
        return None
    at_open = 0 if open_round is None else open_round.learner_tokens.get(learner, 0)
    return key if tokens_total >= at_open + needed else None


def heartbeat_record(runtime: "LearnerRuntime") -> dict:
    progress, book = runtime.progress, runtime.book
    wall, training = progress.wall_seconds(), progress.training_so_far()
    return {"learner": runtime.name, "attempt": runtime.attempt, "pid": os.getpid(),
            "status": progress.status, "time": runtime._clock(),
            "started_at": progress.started_at,
            "step": int(runtime.train.step), "tokens_total": runtime.tokens_total,
            "loss": progress.last_loss, "versions": [f.version for f in runtime.sync.fragments],
            "checkpoint_step": progress.checkpoint_step,
            "compute_seconds": progress.compute_seconds, "wall_seconds": wall,
            "training_seconds": training,
            "offers": book.offers, "received": book.received,
            "declined_rounds": list(book.declined),
            "rejoined_from": progress.rejoined_from,
            "bytes_up": runtime.link.bytes_up, "bytes_down": runtime.link.bytes_down}


def attempt_record(runtime: "LearnerRuntime", final: bool = False,
                   status: str | None = None) -> dict:
    """This process's token ledger; `final` once nothing more can change it."""
    progress = runtime.progress
    return {"learner": runtime.name, "attempt": runtime.attempt,
            "status": status or progress.status, "final": final, "time": time.time(),
            "started_at": progress.started_at, "step": int(runtime.train.step),
            "compute_seconds": progress.compute_seconds,
            "ledger": runtime.ledger.to_record()}


def progress_line(runtime: "LearnerRuntime") -> str:
    beat = heartbeat_record(runtime)
    rate = beat["tokens_total"] / max(beat["wall_seconds"], 1e-9)
    last_loss = runtime.progress.last_loss
    loss = "-" if last_loss is None else f"{last_loss:.4f}"
    return (f"{runtime.name}: step {beat['step']}, train loss {loss}, "
            f"{rate:,.0f} tokens/s, fragment versions {beat['versions']}, "
            f"{runtime.book.offers} offers, {runtime.book.received} merged fragments received, "
            f"compute {beat['compute_seconds'] / max(beat['training_seconds'], 1e-9):.1%} "
            "of the loop")
