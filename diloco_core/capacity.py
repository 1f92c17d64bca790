"""Which learners of the roster have compute now: the capacity record, and how it changes.

Scavenged capacity comes and goes while a run goes on. The roster (`learners.num_learners`)
is fixed at launch, each learner with its own data shard, so data stays disjoint whichever
learners are present; the capacity record says which of them are *absent* (never launched yet,
or released), and keeps every change in order, so a run's learner set can be replayed exactly.

Only the control plane writes it (`diloco capacity`, the `capacity` job, a fault tape's
learner_join / learner_leave, applied by the learner supervisor); learners read it. Like every
record read back from storage it is untrusted: `Capacity.from_json` validates it.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from diloco_core.round_records import (
    _NAMES,
    _TIME,
    MAX_TEXT,
    Check,
    RecordError,
    _int,
    _list,
    _optional,
    _Record,
    _str,
)

ACTIONS = ("join", "leave")
# A run's whole history of changes is kept (a replay needs it); beyond this many the record is
# refused rather than grown without bound (a join or leave a minute for three days).
MAX_CHANGES = 4096


def _action(v: Any) -> str:
    if v not in ACTIONS:
        raise ValueError(f"must be one of {', '.join(ACTIONS)}, got {v!r}")
    return v


@dataclass(frozen=True)
class CapacityChange(_Record):
    """One learner joining or leaving: when (the control plane's clock), who asked, why, and
    the newest round open at the time (None before round 0)."""

    KIND: ClassVar[str] = "capacity_change"
    CHECKS: ClassVar[dict[str, Check]] = {
        "learner": _str(), "action": _action, "at": _TIME, "by": _str(),
        "reason": _str(MAX_TEXT), "round": _optional(_int())}

    learner: str
    action: str
    at: float
    by: str = ""
    reason: str = ""
    round: int | None = None


def _changes(v: Any) -> tuple[CapacityChange, ...]:
    items = _list(lambda x: x, MAX_CHANGES)(v)
    out = []
    for i, item in enumerate(items):
        try:
            out.append(CapacityChange.from_json(item))
        except RecordError as err:
            raise ValueError(f"[{i}] {err}") from None
    return tuple(out)


class CapacityError(ValueError):
    """A change that cannot be made as asked (names the learner and why)."""


@dataclass(frozen=True)
class Capacity(_Record):
    """`absent`: learners of the roster without compute now; `changes`: every join and leave,
    oldest first."""

    KIND: ClassVar[str] = "capacity"
    CHECKS: ClassVar[dict[str, Check]] = {"absent": _NAMES, "changes": _changes}

    absent: tuple[str, ...] = ()
    changes: tuple[CapacityChange, ...] = ()

    @classmethod
    def at_launch(cls, standby: Sequence[str]) -> "Capacity":
        return cls(tuple(sorted(standby)))

    def present(self, roster: Sequence[str]) -> tuple[str, ...]:
        return tuple(n for n in roster if n not in self.absent)

    def change(self, learner: str, action: str, roster: Sequence[str], *, at: float,
               by: str = "", reason: str = "", round_index: int | None = None,
               min_present: int = 1) -> "Capacity":
        """The record after `learner` joins or leaves. Refused: a learner not on the roster, a
        join of a present learner, a leave of an absent one, or a leave that would leave fewer
        than `min_present` learners (the quorum K: no round could merge)."""
        _action(action)
        if learner not in roster:
            raise CapacityError(f"{learner!r} is not on the roster ({', '.join(roster)}); the "
                                "roster is fixed at launch (learners.num_learners)")
        if len(self.changes) >= MAX_CHANGES:
            raise CapacityError(f"the run already recorded {MAX_CHANGES} capacity changes")
        absent = set(self.absent)
        if action == "join":
            if learner not in absent:
                raise CapacityError(f"{learner} is already present")
            absent.discard(learner)
        else:
            if learner in absent:
                raise CapacityError(f"{learner} is already absent")
            present = len(roster) - len(absent)
            if present <= max(min_present, 1):
                raise CapacityError(f"{learner} leaving would leave {present - 1} present "
                                    f"learner(s), fewer than the {max(min_present, 1)} "
                                    "needed (sync.min_quorum): no round could merge")
            absent.add(learner)
        entry = CapacityChange(learner, action, at, by[:128], reason[:MAX_TEXT], round_index)
        return replace(self, absent=tuple(sorted(absent)), changes=self.changes + (entry,))

    def to_json(self) -> dict:
        return {"absent": list(self.absent), "changes": [c.to_json() for c in self.changes]}
