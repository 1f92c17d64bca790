"""The code server's allocator, seen from inside: `long_haul.py --dagster --heap-probe`.

On the Python path of the Dagster processes (the haul sets PYTHONPATH to this folder and
DILOCO_HEAP_PROBE to a file), this starts a thread in the code server's gRPC process (the one
that runs the sensor ticks) that appends a JSON line every 15 s: resident memory, Python's
allocated blocks (pymalloc and object memory: flat when no Python object accumulates) and
glibc's `mallinfo2` over all arenas: the bytes in use and the bytes free but kept. Resident
memory that grows with the in-use bytes and the blocks flat is a native allocation that
accumulates; with both flat and the free bytes growing, it is the allocator keeping what was
freed. Every other process it is imported into is left alone.
"""

import os

_OUT = os.environ.get("DILOCO_HEAP_PROBE")


def _is_code_server() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"api\0grpc" in f.read()
    except OSError:
        return False


def _anonymous_mappings() -> dict:
    """Resident memory of the process's anonymous mappings by kind: glibc's main heap
    (`[heap]`), the unnamed ones (other arenas' heaps, Python's object arenas, large
    allocations, thread stacks' touched pages) and their count."""
    heap = unnamed = count = 0
    name = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 6)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = head[5].strip() if len(head) > 5 else ""
                count += name == ""
            elif head[0] == "Rss:":
                kb = int(head[1])
                heap += kb if name == "[heap]" else 0
                unnamed += kb if name == "" else 0
    return {"main_heap_mb": heap / 1024, "unnamed_mb": unnamed / 1024, "unnamed_maps": count}


def _probe(out: str) -> None:
    import ctypes
    import json
    import sys
    import time

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    while True:
        time.sleep(15)
        with open("/proc/self/status") as f:
            status = {k: int(v.split()[0]) for k, v in
                      (line.split(":", 1) for line in f) if k.startswith("Rss") or k == "VmRSS"}
        info = mallinfo2()
        row = {"t": time.time(), "rss_mb": status["VmRSS"] / 1024,
               "rss_anon_mb": status["RssAnon"] / 1024, "rss_file_mb": status["RssFile"] / 1024,
               "rss_shmem_mb": status["RssShmem"] / 1024, **_anonymous_mappings(),
               "python_blocks": sys.getallocatedblocks(),
               "heap_in_use_mb": (info.uordblks + info.hblkhd) / 2**20,
               "heap_free_mb": info.fordblks / 2**20}
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if _OUT and _is_code_server():
    import threading

    threading.Thread(target=_probe, args=(_OUT,), daemon=True, name="heap-probe").start()
