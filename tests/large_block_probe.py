"""How much of a large block's memory a process keeps after freeing it in its threads: run as a
script in a fresh process (the threshold it probes is process-wide state), it prints the
resident MB still held after four threads have each freed one and the heap was trimmed.

    python tests/large_block_probe.py default    # glibc as it starts
    python tests/large_block_probe.py fixed      # after unmap_large_blocks()
    python tests/large_block_probe.py sensor     # after one quorum-sensor tick, evaluated as
                                                 # the code server evaluates it

glibc maps a large block on its own at first; once one is freed it raises its mmap threshold to
that size, and from then on each thread arena that serves such a block keeps it resident, out
of `malloc_trim`'s reach (`resources/process_memory.py`).
"""

import ctypes
import sys
import threading

BLOCK = 4 * 2**20
THREADS = 4


def _libc():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    return libc


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _touched_and_freed(libc) -> None:
    block = libc.malloc(BLOCK)
    libc.memset(block, 1, BLOCK)
    libc.free(block)


def retained_mb() -> float:
    libc = _libc()
    _touched_and_freed(libc)          # mapped, then freed: the dynamic threshold rises to it
    base = _rss_mb()
    start = threading.Barrier(THREADS)

    def serve() -> None:              # alive together, so each thread has an arena of its own
        start.wait()
        _touched_and_freed(libc)
        start.wait()

    workers = [threading.Thread(target=serve) for _ in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    libc.malloc_trim(0)
    return _rss_mb() - base


def _sensor_tick() -> None:
    import os
    import tempfile

    import dagster as dg
    from dagster._grpc.impl import get_external_sensor_execution

    os.environ["DILOCO_STORE_URI"] = tempfile.mkdtemp()
    os.environ["DILOCO_ENV"] = "local"
    from pipelines.definitions import defs

    repo = defs().get_repository_def()
    with dg.instance_for_test() as instance:
        result = get_external_sensor_execution(repo, None, instance.get_ref(), "quorum_sensor",
                                               None, None, None, None, None)
    assert not hasattr(result, "error"), result


if __name__ == "__main__":
    if sys.argv[1] == "fixed":
        from resources.process_memory import unmap_large_blocks

        assert unmap_large_blocks()
    elif sys.argv[1] == "sensor":
        _sensor_tick()
    print(round(retained_mb(), 2))
