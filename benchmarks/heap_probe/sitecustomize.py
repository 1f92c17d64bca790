"""The code server's allocator, seen from inside: `long_haul.py --dagster --heap-probe`.

On the Python path of the Dagster processes (the haul sets PYTHONPATH to this folder and
DILOCO_HEAP_PROBE to a file), this starts a thread in the code server's gRPC process (the one
that runs the sensor ticks) that appends a JSON line every 15 s: resident memory, Python's
allocated blocks (pymalloc and object memory: flat when no Python object accumulates) and
glibc's `mallinfo2` over all arenas: the bytes in use and the bytes free but kept; glibc's
`malloc_info` arena by arena, and the process's thread count. Resident
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


def _arenas(libc) -> dict:
    """glibc's own account of each arena (`malloc_info`): the memory it holds from the system
    now, arena by arena (arena 0 is the main heap), and its large chunks mapped one by one, so
    that growth in the unnamed mappings can be pinned on one arena or on the mmapped chunks."""
    import re
    import tempfile

    with tempfile.NamedTemporaryFile(mode="r", suffix=".xml") as tmp:
        stream = libc.fopen(tmp.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        text = tmp.read()
    arenas = [int(size) / 2**20 for size in re.findall(
        r'<heap nr="\d+">.*?<system type="current" size="(\d+)"/>', text, re.S)]
    mmap = re.search(r'<total type="mmap" count="(\d+)" size="(\d+)"/>\s*<system type="current"',
                     text)
    return {"arena_mb": arenas,
            "mmap_chunks": int(mmap.group(1)) if mmap else None,
            "mmap_chunks_mb": int(mmap.group(2)) / 2**20 if mmap else None}


def _probe(out: str) -> None:
    import ctypes
    import json
    import sys
    import time

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    mallinfo2 = libc.mallinfo2
    mallinfo2.restype = MallInfo2
    while True:
        time.sleep(15)
        with open("/proc/self/status") as f:
            status = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                      if k.startswith("Rss") or k in ("VmRSS", "Threads")}
        info = mallinfo2()
        row = {"t": time.time(), "rss_mb": status["VmRSS"] / 1024,
               "rss_anon_mb": status["RssAnon"] / 1024, "rss_file_mb": status["RssFile"] / 1024,
               "rss_shmem_mb": status["RssShmem"] / 1024, **_anonymous_mappings(),
               "python_blocks": sys.getallocatedblocks(),
               "heap_in_use_mb": (info.uordblks + info.hblkhd) / 2**20,
               "heap_free_mb": info.fordblks / 2**20, "threads": status["Threads"],
               **_arenas(libc)}
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if _OUT and _is_code_server():
    import threading

    threading.Thread(target=_probe, args=(_OUT,), daemon=True, name="heap-probe").start()
