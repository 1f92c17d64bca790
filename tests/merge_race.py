"""One of two merge processes racing on the same store (run by test_merge_race.py).

    python tests/merge_race.py STORE_URI EXPERIMENT START_AT ROUND [ROUND ...]
        [--progress FILE] [--hold-for FILE]

Waits until the wall clock reaches START_AT (both processes get the same one), then merges each
round, in the order given, with the production merge (`merge_from_store`); a lost
compare-and-swap (`Conflict`) is retried, as the run's retry policy does. Prints what it did per
round as JSON.

--progress FILE: append a line to FILE after each round (and "finished" at the end).
--hold-for FILE: after writing a version and before moving the pointer to it (the merge's
"during_commit" point: a merger stalled there, a slow network, a paused process), wait until the
other process's --progress FILE has two more lines (it has then tried a round of each fragment
with this version pending) or says "finished" (at most 60 s).
"""

import argparse
import json
import os
import time
from pathlib import Path

from diloco_core.config_loading import config_from_mapping
from pipelines.syncer.store_merge import MergePlan, merge_from_store
from resources.store.artifact_store import ArtifactStore, Conflict
from resources.store.backends import open_blob_store


class HoldMidCommit:
    """`merge_from_store`'s fault hooks: stall at "during_commit" until the other merger moves."""

    def __init__(self, other_progress: Path):
        self.other, self.holds = other_progress, []

    def wrap_store(self, store: ArtifactStore) -> ArtifactStore:
        return store

    def _lines(self) -> list[str]:
        return self.other.read_text().splitlines() if self.other.exists() else []

    def at(self, phase: str) -> None:
        if phase != "during_commit":
            return
        seen, deadline = len(self._lines()), time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = self._lines()
            if len(lines) >= seen + 2 or "finished" in lines:
                self.holds.append("released")
                return
            time.sleep(0.01)
        self.holds.append("timed out")


parser = argparse.ArgumentParser()
parser.add_argument("uri")
parser.add_argument("experiment")
parser.add_argument("barrier", type=Path, help="a folder: write ready-<pid>, wait for go")
parser.add_argument("rounds", type=int, nargs="+")
parser.add_argument("--progress", type=Path)
parser.add_argument("--hold-for", type=Path)
args = parser.parse_args()
store = ArtifactStore(open_blob_store(args.uri), args.experiment)
plan = MergePlan.of(config_from_mapping(store.get_config()))
hold = HoldMidCommit(args.hold_for) if args.hold_for else None
# Past the imports and the plan: tell the parent, and start when every process is (a start
# time fixed in advance lost the race to slow imports on a loaded machine).
(args.barrier / f"ready-{os.getpid()}").touch()
while not (args.barrier / "go").exists():
    time.sleep(0.01)
done = {}
for r in args.rounds:
    for attempt in range(5):
        try:
            outcome = merge_from_store(store, r, merge_plan=plan, hooks=hold)
        except Conflict as err:
            done.setdefault("conflicts", []).append(f"round {r}: {err}")
            continue
        done[r] = {"committed": outcome.committed, "version": outcome.version,
                   "fragment": outcome.fragment, "already": outcome.already_committed,
                   "attempts": attempt + 1}
        break
    else:
        done[r] = {"gave_up": True}
    if args.progress:
        with open(args.progress, "a") as out:
            out.write(f"{r}\n")
if args.progress:
    with open(args.progress, "a") as out:
        out.write("finished\n")
if hold is not None:
    done["holds"] = hold.holds
print(json.dumps(done))
