"""The syncer's lease: at most one process decides and merges an experiment's rounds.

A small record in the store (`syncer/LEASE`), moved only by compare-and-swap on its
generation (the blob store's write precondition), so two writers never both move it:

    {"holder": "host:pid:nonce", "attempt": n, "epoch": e, "beat": b,
     "status": "syncing" | "released", "time": t, "pid": p,
     "name": "syncer-a<n>" | "syncer-a<n>-standby", "since": t0}

(`time`: the holder's wall clock at its last write; `since`: when it took the lease; `name`:
who holds it, as its records say. Older records lack the last two.)

- A syncer of attempt n takes the lease when there is none, when it was released, or when an
  older attempt holds it: the supervisor launches attempt n only after attempt n-1's run
  ended or was judged hung, so an older holder that still lives is a zombie. Taking it over
  bumps the epoch, and the zombie's next renewal or check fails.
- While a process of the same attempt holds it and keeps renewing it, a second syncer is
  refused (a duplicate launch never runs); if the holder stopped renewing for `stale_after`
  seconds (watched on the newcomer's own clock), the newcomer takes over. A newer attempt's
  lease is never taken by an older one.
- A same-attempt holder *known to be dead* is taken over at once: the syncer's warm standby
  (`pipelines/syncer/entry.py`) is its child and sees it end (its pipe from the holder
  closes), so it names the holder's pid on this host as `dead_pid` instead of waiting for the
  lease to go stale. Only that pid on this host counts; anything else waits as above.
- The holder renews it every second (a store write per second at most: GCS allows about one
  mutation per second per object). A renewal that loses the CAS means someone took over: the
  holder is fenced and must stop.
- Before each commit-point write (a round record, a decision, a version's pointer move) the
  holder checks that the lease is still at its own generation (one metadata read). What a
  takeover can race between that check and the write is covered by the store itself:
  records are write-once and fragment pointers move by compare-and-swap, so a raced round is
  committed once, never twice.
- Observers (the quorum sensor, the supervisor) judge the syncer live by when they last saw
  the record *change*, on their own clock, as for learner heartbeats: clocks of different
  machines are never compared.
"""

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from resources.store import layout
from resources.store.artifact_store import ArtifactStore
from resources.store.blobs import BlobNotFound, PreconditionFailed
from resources.store.lease_record import LeaseRecord

_logger = logging.getLogger(__name__)

RENEW_SECONDS = 1.0


class LeaseRefused(RuntimeError):
    """Another syncer holds the lease and is alive, or a newer attempt holds it."""


class LeaseLost(RuntimeError):
    """This syncer's lease was taken over: it must not write anything more."""


@dataclass(frozen=True)
class LeaseState:
    record: LeaseRecord
    generation: int


class SyncerLease:
    def __init__(self, store: ArtifactStore, attempt: int,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, name: str | None = None):
        self.store, self.attempt = store, int(attempt)
        # Written into the record so that observers can say who holds it (the standby too).
        self.name = name or f"syncer-a{self.attempt}"
        self.key = layout.syncer_lease(store.experiment)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.clock, self.sleep = clock, sleep
        self.held: LeaseState | None = None
        self._renewed_at = -float("inf")

    # ---- reading ------------------------------------------------------------------------------
    def read(self) -> LeaseState | None:
        """The record and the generation it was read at (consistent: re-read if it moved)."""
        blobs = self.store.blobs
        for _ in range(10):
            info = blobs.info(self.key)
            if info is None:
                return None
            try:
                data = blobs.read(self.key)
            except BlobNotFound:
                continue
            again = blobs.info(self.key)
            if again is None or again.generation != info.generation:
                continue
            try:
                record = json.loads(data)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                record = {}
            return LeaseState(LeaseRecord.from_json(record), info.generation)
        raise LeaseRefused("the lease record keeps changing; cannot read it consistently")

    # ---- taking, keeping and giving it back ---------------------------------------------------
    def acquire(self, stale_after: float, log: logging.Logger = _logger,
                dead_pid: int | None = None) -> LeaseState:
        """Take the lease (see the module docstring), waiting at most `stale_after` seconds
        for a same-attempt holder to go quiet; `LeaseRefused` otherwise. A holder that is
        process `dead_pid` of this host, known to have ended, is taken over at once."""
        started, watched = self.clock(), None
        dead = None if dead_pid is None else f"{socket.gethostname()}:{int(dead_pid)}:"
        while True:
            current = self.read()
            if current is None:
                if self._write(self._record(epoch=1), if_generation=0):
                    return self.held
                continue
            record = current.record
            theirs = -1 if record.attempt is None else record.attempt
            epoch = record.epoch
            if theirs > self.attempt:
                raise LeaseRefused(f"attempt {theirs} of the syncer holds the lease (this is "
                                   f"attempt {self.attempt})")
            if dead is not None and record.holder.startswith(dead):
                pass     # the holder's process ended: nothing to wait for
            elif record.status != "released" and theirs == self.attempt:
                marker, now = record.marker, self.clock()
                if watched is None or watched[0] != marker:
                    watched = (marker, now)
                if now - watched[1] < stale_after:
                    if now - started >= 2 * stale_after:
                        raise LeaseRefused(
                            f"another syncer of attempt {theirs} holds the lease and keeps "
                            f"renewing it ({record.holder})")
                    self.sleep(min(RENEW_SECONDS, stale_after / 4))
                    continue
            if self._write(self._record(epoch=epoch + 1), if_generation=current.generation):
                # A hand-over from a syncer that gave the lease back is routine; any other
                # take-over means a syncer died or stalled holding it.
                (log.info if record.status == "released" else log.warning)(
                    f"syncer attempt {self.attempt}: took the lease (epoch {epoch + 1}) from "
                    f"{record.holder} (attempt {theirs}, {record.status})")
                return self.held

    def renew(self, force: bool = False) -> None:
        """Move the lease on (at most once a second unless `force`); `LeaseLost` if someone
        else moved it."""
        if self.held is None:
            raise LeaseLost("no lease held")
        if not force and self.clock() - self._renewed_at < RENEW_SECONDS:
            return
        record = replace(self.held.record, beat=self.held.record.beat + 1, time=time.time())
        if not self._write(record, if_generation=self.held.generation):
            lost, self.held = self.held, None
            raise LeaseLost(f"syncer attempt {self.attempt} lost the lease (epoch "
                            f"{lost.record.epoch}): another syncer took over")

    def check(self) -> None:
        """Before a commit-point write: still ours? (one metadata read)."""
        if self.held is None:
            raise LeaseLost("no lease held")
        info = self.store.blobs.info(self.key)
        if info is None or info.generation != self.held.generation:
            self.held = None
            raise LeaseLost(f"syncer attempt {self.attempt}: the lease moved; not writing")

    def release(self) -> None:
        """Give the lease back (a clean exit), so the next syncer need not wait."""
        if self.held is None:
            return
        self._write(replace(self.held.record, status="released", time=time.time(),
                            beat=self.held.record.beat + 1),
                    if_generation=self.held.generation)
        self.held = None

    # ---- plumbing -----------------------------------------------------------------------------
    def _record(self, epoch: int) -> LeaseRecord:
        now = time.time()
        return LeaseRecord(holder=self.holder, attempt=self.attempt, epoch=epoch, beat=0,
                           status="syncing", time=now, pid=os.getpid(), name=self.name,
                           since=now)

    def _write(self, record: LeaseRecord, if_generation: int) -> bool:
        data = json.dumps(record.to_json(), sort_keys=True).encode()
        try:
            info = self.store.blobs.write(self.key, data, if_generation=if_generation)
        except PreconditionFailed:
            return False
        self.held = LeaseState(record, info.generation)
        self._renewed_at = self.clock()
        return True
