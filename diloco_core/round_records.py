"""The records the round protocol passes between processes, typed and validated.

A learner writes its heartbeat; the decider (syncer service or quorum sensor) writes round-open
and decision records; everyone reads them back from shared storage. Everything read is
untrusted: `from_json` checks every field's type and bounds and raises `RecordError` naming the
record, the field and the reason; unknown keys are dropped, so what a reader gets back is only
what this schema describes. `to_json` is what is written.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

MAX_NAME = 128          # learner names, deciders, statuses
MAX_TEXT = 4096         # reasons
MAX_ITEMS = 4096        # learners in one record (M is far below this)
MAX_INT = 2 ** 62       # rounds, steps, tokens, bytes: beyond this a record is nonsense


def finite_float(value: Any) -> float | None:
    """A learner-written number as a finite float, or None: json reads NaN, Infinity and
    integers of any size (float(10**400) raises, and math.isfinite calls float)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if isinstance(value, int) and abs(value) >= 2 ** 1023:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class RecordError(ValueError):
    def __init__(self, record: str, field_name: str, reason: str):
        super().__init__(f"{record}.{field_name}: {reason}")
        self.record, self.field, self.reason = record, field_name, reason


Check = Callable[[Any], Any]     # returns the normalized value, raises ValueError with a reason


def _int(lo: int = 0, hi: int = MAX_INT) -> Check:
    def check(v):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise ValueError(f"must be in [{lo}, {hi}]")
        return v
    return check


def _num(lo: float = -math.inf, hi: float = math.inf) -> Check:
    def check(v):
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise ValueError(f"must be a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v) or not lo <= v <= hi:
            raise ValueError(f"must be a finite number in [{lo}, {hi}]")
        return v
    return check


def _optional(check: Check) -> Check:
    return lambda v: None if v is None else check(v)


def _str(limit: int = MAX_NAME) -> Check:
    def check(v):
        if not isinstance(v, str):
            raise ValueError(f"must be a string, got {type(v).__name__}")
        if len(v) > limit:
            raise ValueError(f"longer than {limit} characters")
        return v
    return check


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {type(v).__name__}")
    return v


def _list(item: Check, limit: int = MAX_ITEMS) -> Check:
    def check(v):
        if not isinstance(v, list | tuple):
            raise ValueError(f"must be a list, got {type(v).__name__}")
        if len(v) > limit:
            raise ValueError(f"more than {limit} items")
        return tuple(item(x) for x in v)
    return check


def _map(value: Check, limit: int = MAX_ITEMS) -> Check:
    key = _str()

    def check(v):
        if not isinstance(v, Mapping):
            raise ValueError(f"must be an object, got {type(v).__name__}")
        if len(v) > limit:
            raise ValueError(f"more than {limit} entries")
        return {key(k): value(x) for k, x in v.items()}
    return check


class _Record:
    """Parsing and writing for the frozen dataclasses below (`CHECKS`: field -> check)."""

    KIND: ClassVar[str]
    CHECKS: ClassVar[dict[str, Check]]

    @classmethod
    def from_json(cls, raw: Any):
        if not isinstance(raw, Mapping):
            raise RecordError(cls.KIND, "*", f"must be a JSON object, got {type(raw).__name__}")
        values = {}
        for f in fields(cls):
            if f.name not in raw:
                if f.default is f.default_factory:     # both MISSING: a required field
                    raise RecordError(cls.KIND, f.name, "missing")
                continue
            try:
                values[f.name] = cls.CHECKS[f.name](raw[f.name])
            except (ValueError, TypeError) as err:
                raise RecordError(cls.KIND, f.name, str(err)) from None
        return cls(**values)

    def to_json(self) -> dict:
        """The record as written; an optional field that is None is left out (absent)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else (dict(v) if isinstance(
                v, Mapping) else v)
        return out


_NAMES = _list(_str())
_TIME = _num()


@dataclass(frozen=True)
class RoundOpen(_Record):
    """Round `round` is open for offers of `fragment`; `learner_tokens`: each learner's tokens
    when it opened (the next round opens on progress since then)."""

    KIND: ClassVar[str] = "round_open"
    CHECKS: ClassVar[dict[str, Check]] = {
        "round": _int(), "fragment": _int(hi=MAX_ITEMS), "opened_at": _TIME, "final": _bool,
        "learner_tokens": _map(_int())}

    round: int
    fragment: int
    opened_at: float
    final: bool = False
    learner_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundDecision(_Record):
    """How an open round was decided: who is merged (`members`, in arrival order), who was
    late or missing, why, and the times that decided it (the decider's clock)."""

    KIND: ClassVar[str] = "decision"
    CHECKS: ClassVar[dict[str, Check]] = {
        "round": _int(), "fragment": _int(hi=MAX_ITEMS), "final": _bool,
        "decided_by": _str(), "members": _NAMES, "late": _NAMES, "missing": _NAMES,
        "reason": _str(MAX_TEXT), "grace_seconds": _optional(_num(0.0)),
        "deadline": _optional(_TIME), "opened_at": _TIME, "quorum_at": _TIME,
        "decided_at": _TIME, "arrivals": _map(_TIME), "live": _NAMES, "declined": _NAMES,
        "digests": _map(_str(64)), "payloads": _map(_str(64)), "refused": _map(_str(MAX_TEXT)),
        "bases": _map(_int())}

    round: int
    fragment: int
    members: tuple[str, ...]
    reason: str
    decided_at: float
    final: bool = False
    decided_by: str = "sensor"
    late: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    grace_seconds: float | None = None
    deadline: float | None = None
    opened_at: float = 0.0
    quorum_at: float = 0.0
    arrivals: Mapping[str, float] = field(default_factory=dict)
    live: tuple[str, ...] = ()
    declined: tuple[str, ...] = ()     # live, did not offer: nothing new (final rounds only)
    # What the decision commits to: each member's manifest (SHA-256 of its bytes; the merge
    # refuses anything else in its place) and the payload that manifest names (a later offer
    # of the same payload is a replay or a copy).
    digests: Mapping[str, str] = field(default_factory=dict)
    payloads: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)   # offers refused on arrival
    # Each member's base version: once its merge is published, an offer of the fragment on a
    # base no newer is a replay (a syncer that restarts reads them back from here).
    bases: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Heartbeat(_Record):
    """A learner process's latest state, rewritten every `heartbeat_seconds`. The control plane
    reads its status, attempt, progress (tokens) and the final rounds it declined; the rest is
    for people (status, run summary)."""

    KIND: ClassVar[str] = "heartbeat"
    CHECKS: ClassVar[dict[str, Check]] = {
        "learner": _str(), "attempt": _int(hi=2 ** 31), "pid": _optional(_int()),
        "status": _str(32), "time": _TIME, "started_at": _optional(_TIME), "step": _int(),
        "tokens_total": _int(), "loss": _optional(_num()),
        "versions": _list(_int(), MAX_ITEMS), "checkpoint_step": _optional(_int()),
        "compute_seconds": _num(0.0), "wall_seconds": _num(0.0),
        "training_seconds": _num(0.0), "offers": _int(), "received": _int(),
        "declined_rounds": _list(_int(), 64), "rejoined_from": _optional(_str(MAX_TEXT)),
        "bytes_up": _int(), "bytes_down": _int()}

    status: str
    time: float
    learner: str = ""
    attempt: int = 0
    pid: int | None = None
    started_at: float | None = None
    step: int = 0
    tokens_total: int = 0
    loss: float | None = None
    versions: tuple[int, ...] = ()
    checkpoint_step: int | None = None
    compute_seconds: float = 0.0
    wall_seconds: float = 0.0
    training_seconds: float = 0.0
    offers: int = 0
    received: int = 0
    declined_rounds: tuple[int, ...] = ()
    rejoined_from: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
