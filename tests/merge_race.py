"""One of two merge processes racing on the same store (run by test_merge_race.py).

    python tests/merge_race.py STORE_URI EXPERIMENT START_AT ROUND [ROUND ...]

Waits until the wall clock reaches START_AT (both processes get the same one), then merges each
round with the production merge (`merge_from_store`); a lost compare-and-swap (`Conflict`) is
retried, as the run's retry policy does. Prints what it did per round as JSON."""

import json
import sys
import time

from diloco_core.config_loading import config_from_mapping
from pipelines.store_merge import MergePlan, merge_from_store
from resources.store.artifact_store import ArtifactStore, Conflict
from resources.store.backends import open_blob_store

uri, experiment, start_at, *rounds = sys.argv[1:]
store = ArtifactStore(open_blob_store(uri), experiment)
plan = MergePlan.of(config_from_mapping(store.get_config()))
time.sleep(max(0.0, float(start_at) - time.time()))
done = {}
for r in map(int, rounds):
    for attempt in range(5):
        try:
            outcome = merge_from_store(store, r, merge_plan=plan)
        except Conflict as err:
            done.setdefault("conflicts", []).append(f"round {r}: {err}")
            continue
        done[r] = {"committed": outcome.committed, "version": outcome.version,
                   "already": outcome.already_committed, "attempts": attempt + 1}
        break
    else:
        done[r] = {"gave_up": True}
print(json.dumps(done))
