"""Heartbeats while the training loop is blocked: in its first inner step (XLA compilation), or
in a checkpoint save.

The first step of every learner process compiles the step program: seconds on a CPU (more with
several learners compiling on the same cores), minutes for a large model on a TPU slice. The loop
cannot publish heartbeats meanwhile, and the supervisor (`learner_supervisor`) takes a heartbeat
that stops changing for `learner_timeout_seconds` for a hang and ends the learner, which then
compiles again from scratch at its next attempt. So during that step a thread republishes the
last heartbeat with a fresh time and status "starting", for at most `limit` seconds: a compile
(or first step) that truly hangs still goes silent and is ended. A checkpoint save (seconds to
minutes for a large model on GCS) blocks the loop the same way; its beacon keeps the learner's
status ("training", "stopping") and counts `checkpointing_seconds`.
"""

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any


class CompileBeacon:
    """Context manager: `publish({**beat, "status": status, ...})` every `every` seconds
    until the block exits or `limit` seconds have passed; `doing` names what blocks
    (`{doing}_seconds` in the beat)."""

    def __init__(self, publish: Callable[[dict], None], beat: Mapping[str, Any], every: float,
                 limit: float, clock: Callable[[], float] = time.time,
                 status: str = "starting", doing: str = "compiling"):
        self.publish, self.beat, self.every, self.limit, self.clock = (
            publish, dict(beat), every, limit, clock)
        self.status, self.doing = status, doing
        self.beats = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compile-beacon", daemon=True)

    def __enter__(self) -> "CompileBeacon":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        # XLA releases the GIL while it compiles, so this thread keeps its pace.
        while not self._done.wait(self.every):
            waited = time.monotonic() - self._started
            if waited > self.limit:
                return
            self.publish({**self.beat, "status": self.status, "time": self.clock(),
                          f"{self.doing}_seconds": round(waited, 1)})
            self.beats += 1
