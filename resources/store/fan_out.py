"""Many small independent reads at once, results in the order asked.

The control plane reads one object per learner each tick (heartbeats, new offers' manifests).
One after another that is M round trips: at tens of milliseconds a read on GCS, seconds per tick
at a few hundred learners. `fan_out` runs them on a bounded pool of threads (the reads wait on
the network or the disk, not on the interpreter) and hands the results back in the order of
`items`, whatever order the threads finish in: what a caller decides from them never depends
on thread timing.
"""

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def fan_out(read: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """`[read(item) for item in items]`, with up to `workers` reads in flight. An exception
    from any read is raised here (the first in `items` order), after every read has ended:
    `read` itself turns what one untrusted record may cause into a value."""
    items = list(items)
    workers = min(max(1, int(workers)), len(items))
    if workers <= 1:
        return [read(item) for item in items]
    # A pool per call, not per store: stores are made and dropped freely (each sensor tick
    # opens one), and idle threads must not outlive them. Starting a few threads costs
    # microseconds against the milliseconds of the reads.
    with ThreadPoolExecutor(workers, thread_name_prefix="store-read") as pool:
        futures = [pool.submit(read, item) for item in items]
    return [future.result() for future in futures]
