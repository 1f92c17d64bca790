"""The syncer's state machine in JSON: its state, what it observes and what it decides.

The state: the quorum sensor keeps it as its cursor between ticks, and the syncer service keeps
it in memory the same way. Keys are those of the cursor before the state machine existed, so a
cursor written by an older version still reads; one that does not read raises `ValueError`, and
the driver rebuilds the state from the store as for a lost cursor.

Observations and actions: a recorded trace of a real run (`pipelines/syncer/trace.py`) is
replayed through `step` (`syncer_replay`). JSON keeps floats exactly, so a replay decides to
the bit what the run decided.
"""

from collections.abc import Mapping
from typing import Any

from diloco_core.quorum import Estimates
from diloco_core.round_records import Heartbeat
from diloco_core.syncer_events import (
    Action,
    Decide,
    FinishRun,
    Observed,
    OfferDigest,
    OfferSeen,
    OpenRound,
    StopRequest,
    StopRun,
    VersionSeen,
)
from diloco_core.syncer_machine import Accounts, Pending, SyncerState


def state_to_json(s: SyncerState) -> dict:
    e = s.estimates
    return {
        "experiment": s.experiment, "round": s.round, "fragment": s.fragment,
        "decided": s.decided, "final": s.final, "opened_at": s.opened_at,
        "tokens_at_open": dict(s.tokens_at_open), "arrivals": dict(s.arrivals),
        "watch": {str(k): list(v) for k, v in s.watch.items()},
        "pending": [{"round": p.round, "fragment": p.fragment, "decided_at": p.decided_at,
                     "bases": dict(p.bases), "credits": dict(p.credits)} for p in s.pending],
        "estimates": None if e is None else {"step_seconds": e.step_seconds,
                                             "quorum_seconds": e.quorum_seconds,
                                             "sync_seconds": e.sync_seconds},
        "stop": s.stop, "final_left": s.final_left, "finished": s.finished,
        "digests": {n: [d.manifest, d.payload, d.base, d.tokens, d.steps]
                    for n, d in s.digests.items()},
        "payloads": {k: list(v) for k, v in s.payloads.items()},
        "refused": dict(s.refused),
        "bases": {n: {str(f): list(v) for f, v in b.items()} for n, b in s.bases.items()},
        "seen": {n: list(v) for n, v in s.seen.items()},
        "accounts": {n: {str(f): t for f, t in a.items()}
                     for n, a in s.accounts.offered.items()},
        "account_base": dict(s.accounts.base),
        "account_began": dict(s.accounts.began),
    }


def _map(raw: Any, name: str) -> Mapping:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{name} must be an object")
    return raw


def state_from_json(raw: Any) -> SyncerState:
    """The state a cursor holds; `ValueError` (or `TypeError`) if it is not one."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("experiment"), str):
        raise ValueError("not a syncer state")
    e = raw.get("estimates")
    digests = {}
    for name, d in _map(raw.get("digests"), "digests").items():
        manifest, payload, base, *counters = d
        tokens, steps = (counters + [0, 0])[:2]
        digests[str(name)] = OfferDigest(str(manifest), str(payload), int(base), int(tokens),
                                         int(steps))
    return SyncerState(
        experiment=raw["experiment"], round=int(raw.get("round", -1)),
        fragment=int(raw.get("fragment", 0)), decided=bool(raw.get("decided", True)),
        final=bool(raw.get("final", False)), opened_at=float(raw.get("opened_at", 0.0)),
        tokens_at_open={str(k): int(v) for k, v
                        in _map(raw.get("tokens_at_open"), "tokens_at_open").items()},
        arrivals={str(k): float(v) for k, v in _map(raw.get("arrivals"), "arrivals").items()},
        watch={int(k): tuple(str(n) for n in v)
               for k, v in _map(raw.get("watch"), "watch").items()},
        pending=tuple(Pending(int(p["round"]), int(p["fragment"]), float(p["decided_at"]),
                              {str(k): int(v) for k, v in _map(p.get("bases"), "bases").items()},
                              {str(k): int(v)
                               for k, v in _map(p.get("credits"), "credits").items()})
                      for p in raw.get("pending") or ()),
        estimates=None if e is None else Estimates(float(e["step_seconds"]),
                                                   float(e["quorum_seconds"]),
                                                   float(e["sync_seconds"])),
        stop=bool(raw.get("stop", False)),
        final_left=None if raw.get("final_left") is None else int(raw["final_left"]),
        finished=bool(raw.get("finished", False)), digests=digests,
        payloads={str(k): (str(v[0]), int(v[1]))
                  for k, v in _map(raw.get("payloads"), "payloads").items()},
        refused={str(k): str(v) for k, v in _map(raw.get("refused"), "refused").items()},
        bases={str(n): {int(f): (int(v[0]), int(v[1])) for f, v in _map(b, "bases").items()}
               for n, b in _map(raw.get("bases"), "bases").items()},
        seen={str(n): [v[0], float(v[1])] for n, v in _map(raw.get("seen"), "seen").items()},
        accounts=Accounts(
            offered={str(n): {int(f): int(t) for f, t in _map(a, "accounts").items()}
                     for n, a in _map(raw.get("accounts"), "accounts").items()},
            base={str(n): int(t)
                  for n, t in _map(raw.get("account_base"), "account_base").items()},
            began={str(n): float(t)
                   for n, t in _map(raw.get("account_began"), "account_began").items()}))


def _digest_to_json(d: OfferDigest | None) -> list | None:
    return None if d is None else [d.manifest, d.payload, d.base, d.tokens, d.steps]


def observed_to_json(o: Observed) -> dict:
    return {
        "now": o.now,
        "beats": {n: None if b is None else b.to_json() for n, b in o.beats.items()},
        "refused_beats": dict(o.refused_beats), "absent": sorted(o.absent), "budget": o.budget,
        "stop_request": None if o.stop_request is None else [o.stop_request.requested_by,
                                                             o.stop_request.reason],
        "versions": {str(f): [v.round, list(v.members)] for f, v in o.versions.items()},
        "offers": [[x.round, x.learner, _digest_to_json(x.digest), x.rejected, x.created]
                   for x in o.offers],
        "current_versions": {str(f): v for f, v in o.current_versions.items()},
        "merged": {str(r): list(m) for r, m in o.merged.items()},
    }


def observed_from_json(raw: Mapping) -> Observed:
    stop = raw.get("stop_request")
    return Observed(
        now=float(raw["now"]),
        beats={n: None if b is None else Heartbeat.from_json(b)
               for n, b in raw["beats"].items()},
        refused_beats=dict(raw["refused_beats"]), absent=frozenset(raw["absent"]),
        budget=int(raw["budget"]),
        stop_request=None if stop is None else StopRequest(*stop),
        versions={int(f): VersionSeen(int(v[0]), tuple(v[1]))
                  for f, v in raw["versions"].items()},
        offers=tuple(OfferSeen(int(r), str(n), None if d is None else OfferDigest(*d),
                               rejected, created)
                     for r, n, d, rejected, created in raw["offers"]),
        current_versions={int(f): int(v) for f, v in raw["current_versions"].items()},
        merged={int(r): tuple(m) for r, m in (raw.get("merged") or {}).items()})


def action_to_json(a: Action) -> dict:
    """An action as the record it writes (what a replay compares)."""
    if isinstance(a, StopRun):
        return {"stop": a.record()}
    if isinstance(a, Decide):
        return {"decide": a.decision.to_json()}
    if isinstance(a, OpenRound):
        return {"open": a.record.to_json()}
    if isinstance(a, FinishRun):
        return {"finish": {"at": a.at, "last_round": a.last_round}}
    raise TypeError(f"not an action: {a!r}")
