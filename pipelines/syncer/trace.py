"""Record what the syncer's driver observed and decided, tick by tick, for replay.

Set `DILOCO_SYNCER_TRACE` to a directory and every syncer service process appends its trace
there, one gzip'd JSON-lines file per process: the config, each session's starting state, then
each tick (`diloco_core.syncer_replay` reads it back). The quorum sensor's fallback is not
traced (it decides only while no syncer is live). It costs a JSON encoding per tick, so it is
off unless asked for; a committed trace of a real run is the fixture of
`tests/test_syncer_trace.py` (`tests/fixtures/syncer_trace/`).
"""

import gzip
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from diloco_core.syncer_events import Action, Observed
from diloco_core.syncer_machine import SyncerState
from diloco_core.syncer_replay import state_digest
from diloco_core.syncer_state_codec import action_to_json, observed_to_json, state_to_json

TRACE_ENV = "DILOCO_SYNCER_TRACE"


class SyncerTrace:
    def __init__(self, path: str | Path, config: Mapping):
        self.path = Path(path)
        self._last: SyncerState | None = None
        self._write({"kind": "config", "config": dict(config)})

    @classmethod
    def from_env(cls, who: str, config: Mapping) -> "SyncerTrace | None":
        directory = os.environ.get(TRACE_ENV)
        if not directory:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        return cls(Path(directory) / f"{who}-{os.getpid()}.jsonl.gz", config)

    def _write(self, record: Mapping) -> None:
        # One gzip member per record: a process killed mid-run leaves a readable file.
        with gzip.open(self.path, "at", encoding="utf-8") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def tick(self, before: SyncerState, decided_by: str, observed: Observed,
             actions: Sequence[Action], after: SyncerState,
             planted: Sequence[tuple[int, list[str]]], carried: SyncerState) -> None:
        """One tick: `after`, the state `step` returned; `carried`, the one the driver goes
        on with (`after` with the planted offers noted). A session record comes first when the
        state is not the one the last tick left (the first tick, or a state rebuilt from the
        store)."""
        if before != self._last:
            self._write({"kind": "session", "decided_by": decided_by,
                         "state": state_to_json(before)})
        self._write({"kind": "tick", "observed": observed_to_json(observed),
                     "actions": [action_to_json(a) for a in actions],
                     "state": state_digest(after), "planted": [list(p) for p in planted]})
        self._last = carried


def read_trace(path: str | Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
