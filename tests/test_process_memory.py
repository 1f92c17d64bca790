"""Freed heap handed back to the system (`resources/process_memory.py`), and the syncer's loop
doing it: the long haul's memory creep was the allocator keeping what was freed."""

import subprocess
import sys
from pathlib import Path

import dagster as dg
from orchestration_harness import Harness

from pipelines.syncer import service as syncer_service
from resources.process_memory import release_free_heap

FRAGMENTED = """
import sys
from resources.process_memory import release_free_heap
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
# Past pymalloc's 512-byte objects: these come from the C allocator. Keeping every 64th pins
# the heap's top, so the allocator cannot give the rest back by shrinking it.
blocks = [bytes(1500) + bytes([i % 256]) for i in range(60_000)]
kept = blocks[::64]
del blocks
freed = rss()
released = release_free_heap() if sys.argv[1] == "release" else False
print(released, (freed - rss()) / 1024)
"""


def _freed_mb(mode: str) -> tuple[bool, float]:
    out = subprocess.run([sys.executable, "-c", FRAGMENTED, mode], capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", float(out[1])


def test_released_heap_goes_back_to_the_system():
    """~90 MB allocated, 1 in 64 blocks kept: without a release the process keeps its memory;
    with one, most of it goes back."""
    assert _freed_mb("keep")[1] < 5
    released, mb = _freed_mb("release")
    assert released and mb > 40, mb


def _large_block_retained_mb(mode: str) -> float:
    probe = Path(__file__).with_name("large_block_probe.py")
    out = subprocess.run([sys.executable, str(probe), mode], capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[-1])


def test_large_blocks_freed_in_threads_go_back_once_the_threshold_is_fixed():
    """Four threads each free a 4 MB block after glibc raised its mmap threshold to that size:
    as glibc starts, each thread's arena keeps its block past a trim (16 MB); with the threshold
    fixed each block is unmapped when freed."""
    assert _large_block_retained_mb("default") > 12
    assert _large_block_retained_mb("fixed") < 2


def test_release_is_harmless_called_often():
    assert all(release_free_heap() for _ in range(100))


def test_the_syncer_releases_free_heap_as_it_reports_progress(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(syncer_service, "release_free_heap", lambda: calls.append(1))
    monkeypatch.setattr(syncer_service, "PROGRESS_SECONDS", 0.0)
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    overrides=["orchestration.syncer=service",
                               "orchestration.syncer_poll_seconds=0.05"])
        h.start()
        syncer_service.SyncerService(h.store, attempt=0).run(max_seconds=1.0)
    assert len(calls) >= 3
