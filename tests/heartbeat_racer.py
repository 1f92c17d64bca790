"""A learner's store link writing heartbeats as fast as it can (for the fencing race test):

    python tests/heartbeat_racer.py STORE_URI EXPERIMENT ATTEMPT SECONDS

Prints {"superseded_by": N or null} when a newer attempt's heartbeat stopped it, or at the end.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resources.learner.store_link import StoreLink  # noqa: E402
from resources.store.artifact_store import ArtifactStore  # noqa: E402
from resources.store.backends import open_blob_store  # noqa: E402


def main() -> None:
    uri, experiment, attempt, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(
        sys.argv[4])
    store = ArtifactStore(open_blob_store(uri), experiment)
    link = StoreLink(store, "learner-0", 1, [0], poll_seconds=0.0005, log=lambda _: None,
                     attempt=attempt)
    until = time.monotonic() + seconds
    while time.monotonic() < until and link.superseded_by is None:
        link.heartbeat({"learner": "learner-0", "attempt": attempt, "status": "training",
                        "time": time.time()})
        time.sleep(0.0002)
    link.close(10)
    print(json.dumps({"superseded_by": link.superseded_by}), flush=True)


if __name__ == "__main__":
    main()
