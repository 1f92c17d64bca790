"""What the syncer's state machine (`syncer_machine`) observes and what it decides: the events
one tick reads from the store, and the actions a driver writes back. Typed records, so nothing
between the store's codec and the rules reads a record by string key."""

from collections.abc import Mapping
from dataclasses import dataclass, field

from diloco_core.round_records import Heartbeat, RoundDecision, RoundOpen


# ---- what a tick observes ---------------------------------------------------------------------
@dataclass(frozen=True)
class OfferDigest:
    """What the store vouches for of one committed offer: the SHA-256 of its manifest (what a
    decision commits to), of its payload (tells replays and copies), its base version, and the
    counters it claims (the account credits them as far as the pace allows)."""

    manifest: str
    payload: str
    base: int
    tokens: int
    steps: int


@dataclass(frozen=True)
class OfferSeen:
    """An offer a tick listed for the first time. `digest`: what the store vouches for, read
    for every offer of a configured learner (None: a stray writer's, or the store refused the
    manifest: `rejected` says why);
    `created`: when the store created its payload, read only when two offers of this tick
    carry the same payload (the later is the copy)."""

    round: int
    learner: str
    digest: OfferDigest | None = None
    rejected: str | None = None
    created: float | None = None


@dataclass(frozen=True)
class VersionSeen:
    """A fragment's current version as its metadata says: the round that merged it and the
    members it took."""

    round: int
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class StopRequest:
    requested_by: str
    reason: str


@dataclass(frozen=True)
class Observed:
    """One tick's reading of the store. `beats`: each configured learner's validated heartbeat
    (None: none, or refused: `refused_beats` says why); `absent`: learners the capacity record
    marks absent; `budget`: the token budget in force; `stop_request`: an operator's, if read
    this tick; `versions`: current versions of fragments with merges pending; `offers`: offers
    listed for the first time, in listing order; `current_versions`: of the fragments new
    offers are for (an offer's staleness bounds its credit); `merged`: for a pending merge
    whose fragment a later round's version has passed before a tick saw it, the members of the
    version that merged it (an empty tuple: it was not merged)."""

    now: float
    beats: Mapping[str, Heartbeat | None] = field(default_factory=dict)
    refused_beats: Mapping[str, str] = field(default_factory=dict)
    absent: frozenset[str] = frozenset()
    budget: int | None = None          # None: not known, so never reached
    stop_request: StopRequest | None = None
    versions: Mapping[int, VersionSeen] = field(default_factory=dict)
    offers: tuple[OfferSeen, ...] = ()
    current_versions: Mapping[int, int] = field(default_factory=dict)
    merged: Mapping[int, tuple[str, ...]] = field(default_factory=dict)


# ---- what it decides --------------------------------------------------------------------------
@dataclass(frozen=True)
class StopRun:
    reason: str
    at: float
    tokens: int
    final_left: int

    def record(self) -> dict:
        return {"reason": self.reason, "at": self.at, "tokens": self.tokens,
                "final_left": self.final_left}


@dataclass(frozen=True)
class Decide:
    decision: RoundDecision


@dataclass(frozen=True)
class OpenRound:
    """Open round `record.round`. The driver lists the offers already there *before* it writes
    the record (they were planted: nobody honest could know the round) and hands them to
    `planted`."""

    record: RoundOpen


@dataclass(frozen=True)
class FinishRun:
    at: float
    last_round: int


Action = StopRun | Decide | OpenRound | FinishRun


