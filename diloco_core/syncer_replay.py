"""Replay a recorded trace of the syncer through its state machine.

A trace (recorded by `pipelines/syncer/trace.py` from a real run) holds the run's config, each
driver session's starting state (a syncer's first tick, or the state it rebuilt from the store
after a restart or a lost race), and, for every tick, what the driver observed, the actions
the machine returned, a digest of the state it returned, and the offers the driver found
planted when it opened a round. Replaying feeds the same observations to `step` and compares:
the machine is pure, so every decision and every state must come out the same. A rule change
that would have decided the recorded run differently shows up here, tick by tick.
"""

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from diloco_core.config_loading import config_from_mapping
from diloco_core.syncer_machine import SyncerState, planted, step
from diloco_core.syncer_state_codec import (
    action_to_json,
    observed_from_json,
    state_from_json,
    state_to_json,
)


def state_digest(state: SyncerState) -> str:
    """A short digest of the state (what a trace records each tick instead of the state)."""
    body = json.dumps(state_to_json(state), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclass
class Replayed:
    sessions: int = 0
    ticks: int = 0
    actions: list[dict] = field(default_factory=list)      # every action, as replayed
    mismatches: list[str] = field(default_factory=list)


def replay(records: Iterable[Mapping]) -> Replayed:
    out = Replayed()
    cfg, state, decided_by = None, None, "sensor"
    for n, record in enumerate(records):
        kind = record.get("kind")
        if kind == "config":
            cfg = config_from_mapping(record["config"])
        elif kind == "session":
            state, decided_by = state_from_json(record["state"]), record["decided_by"]
            out.sessions += 1
        elif kind == "tick":
            if cfg is None or state is None:
                raise ValueError(f"record {n}: a tick before the config and a session")
            stepped = step(state, observed_from_json(record["observed"]), cfg, decided_by)
            got = [action_to_json(a) for a in stepped.actions]
            out.ticks += 1
            out.actions.extend(got)
            if got != record["actions"]:
                out.mismatches.append(f"record {n}: actions {got} != recorded "
                                      f"{record['actions']}")
            if state_digest(stepped.state) != record["state"]:
                out.mismatches.append(f"record {n}: the state differs from the recorded one")
            state = stepped.state
            for r, names in record.get("planted", ()):
                state = planted(state, r, names)
    return out
