"""Freed heap handed back to the operating system, for processes that run for weeks.

A long haul of the syncer (benchmarks/long_haul.py) grew its resident memory by ~7 MB every
1,000 rounds while the Python objects it holds stayed flat (a tracemalloc probe: no growth
between snapshots 250 rounds apart). The growth is glibc's allocator keeping freed chunks of
its arenas (every round decodes, merges and encodes on worker threads, each allocation its own
size): `malloc_trim(0)` returned 29-59 MB of it at once, and with a trim every 250 rounds the
syncer's memory stayed flat. Off glibc (musl, macOS) there is no such call; nothing is done.
"""

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the allocator's free memory to the system; whether it could be asked."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
