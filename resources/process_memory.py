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

# glibc's mallopt parameter (malloc.h), and its own starting value for it.
_M_MMAP_THRESHOLD = -3
_GLIBC_MMAP_THRESHOLD = 128 * 1024


@functools.cache
def _libc_function(name: str, argtypes: tuple, restype) -> Callable | None:
    """A glibc function, or None off glibc."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes, function.restype = list(argtypes), restype
    return function


def _malloc_trim() -> Callable[[int], int] | None:
    return _libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


def release_free_heap() -> bool:
    """Return the allocator's free memory to the system; whether it could be asked."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def unmap_large_blocks() -> bool:
    """Fix glibc's mmap threshold at its starting 128 KiB, so that every large block is a mapping
    of its own, handed back to the system when freed; whether it could be set (once a process).

    By default glibc raises the threshold to the size of each mapped block freed (up to 32 MiB).
    After that, blocks of that size come from the arena of the thread asking, and the trim
    threshold rises with it (twice the mmap threshold), so each thread arena that once served
    such a block keeps it resident for good: `malloc_trim` trims only the main arena's top. The
    code server's gRPC threads do exactly that: its heap probe (`benchmarks/heap_probe/`) saw
    thread arenas step up 3.4 MB at a time, the first step as a mapped block of about that size
    was freed, with the bytes in use flat (what allocates the block was not traced). Fixing
    the threshold turns the dynamic raise off; the price is a map and an unmap per large
    block, which a process ticking sensors every few seconds does not notice.
    """
    mallopt = _libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD) == 1
