"""Retrying a conditional write that lost a race, with jittered exponential backoff.

Two writers that retry a lost compare-and-swap at once keep colliding, and on a loaded
machine the slower one can lose every attempt (CI saw 10 straight losses of a capacity change
to a faster peer). A random pause before each retry, doubling up to a cap, lets the slower
writer land its read-modify-write between the other's (the "full jitter" scheme).
"""

import random
import time
from collections.abc import Iterator

ATTEMPTS = 40
FIRST_PAUSE_SECONDS = 0.005
MAX_PAUSE_SECONDS = 0.5


def retries(n: int = ATTEMPTS, *, first: float = FIRST_PAUSE_SECONDS,
             cap: float = MAX_PAUSE_SECONDS) -> Iterator[int]:
    """Yields 0..n-1; before every attempt after the first, sleeps a uniform random time up
    to `first` x 2^(attempt-1), capped at `cap`. The caller `continue`s on a conflict and
    raises once the loop ends."""
    for attempt in range(n):
        if attempt:
            time.sleep(random.uniform(0.0, min(cap, first * 2 ** (attempt - 1))))
        yield attempt
