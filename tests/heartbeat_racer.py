"""A learner's store link writing heartbeats as fast as it can (for the fencing race test):

    python tests/heartbeat_racer.py STORE_URI EXPERIMENT ATTEMPT SECONDS [SLOW_FLAG WRITE_LOG]

Prints {"superseded_by": N or null} when a newer attempt's heartbeat stopped it, or at the end.

SLOW_FLAG: once that file exists, the link pauses `SLOW_SECONDS` between reading the heartbeat
and writing its own (a zombie's stall: a GC pause, a slow network), which opens the window a
newer attempt's first heartbeat lands in. WRITE_LOG: every heartbeat this process stored is
appended as "GENERATION ATTEMPT" (on a local store, generations count a key's writes, so the
logs of all processes merge into the order the writes landed in).
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resources.learner.store_link import StoreLink  # noqa: E402
from resources.store import layout  # noqa: E402
from resources.store.artifact_store import ArtifactStore  # noqa: E402
from resources.store.backends import open_blob_store  # noqa: E402

SLOW_SECONDS = 0.05


def main() -> None:
    uri, experiment, attempt, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(
        sys.argv[4])
    slow_flag, write_log = (sys.argv[5], sys.argv[6]) if len(sys.argv) > 6 else (None, None)
    store = ArtifactStore(open_blob_store(uri), experiment)
    if slow_flag is not None:
        _instrument(store, attempt, slow_flag, write_log)
    link = StoreLink(store, "learner-0", 1, [0], poll_seconds=0.0005,
                     attempt=attempt)
    until = time.monotonic() + seconds
    while time.monotonic() < until and link.superseded_by is None:
        link.heartbeat({"learner": "learner-0", "attempt": attempt, "status": "training",
                        "time": time.time()})
        time.sleep(0.0002)
    link.close(10)
    print(json.dumps({"superseded_by": link.superseded_by}), flush=True)


def _instrument(store: ArtifactStore, attempt: int, slow_flag: str, write_log: str) -> None:
    read, write = store.heartbeat_generation, store.blobs.write
    key = layout.heartbeat(store.experiment, "learner-0")
    log = open(write_log, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def stalled_read(learner):
        seen = read(learner)
        if os.path.exists(slow_flag):
            time.sleep(SLOW_SECONDS)
        return seen

    def logged_write(k, data, **kwargs):
        info = write(k, data, **kwargs)
        if k == key:
            log.write(f"{info.generation} {attempt}\n")
        return info

    store.heartbeat_generation = stalled_read
    store.blobs.write = logged_write


if __name__ == "__main__":
    main()
