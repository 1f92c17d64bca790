"""The learner's link to the store, on a background thread, so training never waits on I/O.

The thread uploads contributions and heartbeats in order (a heartbeat is not written over one
from a newer attempt of the same learner: the link then reports `superseded_by`), and every
`poll_seconds` reads the small control records (the OPEN round pointer, the STOP marker, the
capacity record, the budget forecast, each fragment's CURRENT pointer), downloading a fragment
only when its version moved. The training loop takes what arrived between steps. Store errors
are retried on the next cycle; the thread never raises into the training loop, it reports
through `log`.
"""

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco_core.budget_forecast import PAUSE_SECONDS, BudgetForecast
from diloco_core.contribution import Contribution
from diloco_core.round_records import RoundOpen
from diloco_core.stored_merge import StoredMerge
from resources.learner.hooks import AfterPut
from resources.store.artifact_store import Conflict, RejectedArtifact
from resources.store.learner_view import LearnerView

_logger = logging.getLogger(__name__)
_UNREAD = object()     # no poll has read the forecast yet

# Versions skipped between two polls whose metadata is read to learn which merges took this
# learner's offer; an offer further back than that is taken as merged (the rule before).
MERGES_LOOKED_BACK = 16


@dataclass(frozen=True)
class Arrival:
    """A newer merged version of a fragment, as the learner takes it."""

    version: int
    values: dict
    merged_round: int | None        # the round whose merge made it (None if unknown)
    # For each round whose merge made a version since the one the learner last took: whether
    # it took this learner's offer (`LearnerSync.offer_fate`); `complete` if that names all.
    merged_with: dict[int, bool] = field(default_factory=dict)
    complete: bool = False


@dataclass(frozen=True)
class Polled:
    """The control records the last poll read, replaced together (the loop never sees an open
    round from one poll beside a STOP from another): the OPEN round, STOP, a leave request
    (once asked to leave, the learner leaves), and this learner's target in the budget
    forecast with when (this process's monotonic clock) that forecast was first read."""

    open_round: RoundOpen | None = None
    stop: dict | None = None
    leave: dict | None = None
    target: int | None = None
    target_since: float = 0.0
    forecast_at: float | None = None     # the decider's time on that forecast


class StoreLink:
    def __init__(self, store: LearnerView, learner: str, num_fragments: int,
                 known_versions: list[int], poll_seconds: float,
                 log: logging.Logger = _logger, attempt: int = 0,
                 standby: tuple[str, ...] = ()):
        self.store, self.learner, self.poll_seconds, self.log = store, learner, poll_seconds, log
        self._num_fragments = num_fragments
        self._known = list(known_versions)
        self._lock = threading.Lock()
        self._merged: dict[int, tuple[int, dict, int | None]] = {}
        self._polled = Polled()
        self._forecast_refused = False
        self._found_at_start: float | None | object = _UNREAD   # the first poll's forecast
        self._standby = tuple(standby)   # absent at launch, until the capacity record says
        self._outbox: queue.Queue = queue.Queue()
        self._pending: list[tuple[str, Any]] = []
        self._beat: dict | None = None
        self._record: dict | None = None
        self._record_written_at = float("-inf")   # "time" of the newest attempt record stored
        self.attempt = attempt
        self.superseded_by: int | None = None   # a newer attempt of this learner is running
        self.bytes_up = 0
        self.bytes_down = 0
        self._thread = threading.Thread(target=self._run, name=f"store-link-{learner}",
                                        daemon=True)
        self._thread.start()

    # ---- called from the training loop (never blocks on the store) ----------------------------
    def offer(self, contribution: Contribution, extra: Mapping[str, Any],
              after_put: AfterPut | None = None,
              record: Mapping[str, Any] | None = None) -> None:
        """Queue an upload; `after_put` runs once it is committed (fault injection only).

        `record`, this process's attempt record with the offer's claim in its ledger, is written
        *before* the contribution (write-ahead): a process killed between the two leaves a
        claim without an offer, which the token ledger counts ("offer_not_stored"), never an
        offer that no record accounts for.
        """
        self._outbox.put(("contribution", (contribution, dict(extra), after_put,
                                           None if record is None else dict(record))))

    def heartbeat(self, beat: Mapping[str, Any], record: Mapping[str, Any] | None = None
                  ) -> None:
        """The newest heartbeat, and this process's attempt record (its token ledger)."""
        with self._lock:
            self._beat = dict(beat)   # only the newest matters; never queued behind uploads
            if record is not None:
                self._record = dict(record)

    def take_merged(self) -> dict[int, "Arrival"]:
        """Newer merged fragments that arrived since the last call (`Arrival`)."""
        with self._lock:
            merged, self._merged = self._merged, {}
        return merged

    @property
    def open_round(self) -> RoundOpen | None:
        with self._lock:
            return self._polled.open_round

    @property
    def stop(self) -> dict | None:
        """What ends this learner's training: STOP (the run ends), or a leave request (this
        learner's capacity is reclaimed; marked `"leave": True`). STOP wins if both."""
        with self._lock:
            return self._polled.stop or self._polled.leave

    @property
    def pause_target(self) -> int | None:
        """The total at which this learner pauses (`diloco_core/budget_forecast.py`), or None:
        no forecast names it, or the one that does is older than `PAUSE_SECONDS` (the syncer
        wrote none since: the learner trains on rather than wait on a syncer that is gone)."""
        with self._lock:
            polled = self._polled
        if polled.target is None or time.monotonic() - polled.target_since > PAUSE_SECONDS:
            return None
        return polled.target

    def fenced(self) -> bool:
        """Whether a newer attempt of this learner has started (read from the store now, not
        at the last heartbeat): a process that was replaced (a zombie: its run worker died,
        or it hung past its timeout and came back) must write nothing more of its own, not
        an offer (its progress would count twice when the new attempt offers the same steps
        from its checkpoint) and not a checkpoint (the new attempt may be restoring it)."""
        if self.superseded_by is None:
            current = self.store.get_heartbeat(self.learner)
            if current is not None and current.attempt > self.attempt:
                self.superseded_by = current.attempt
        return self.superseded_by is not None

    def close(self, timeout: float = 60.0) -> None:
        """Flush every queued upload, then stop the thread."""
        self._outbox.put(("close", None))
        self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        next_poll = 0.0
        closing = False
        while True:
            timeout = max(0.0, next_poll - time.monotonic())
            try:
                kind, item = self._outbox.get(timeout=timeout)
                if kind == "close":
                    closing = True
                else:
                    self._pending.append((kind, item))
            except queue.Empty:
                pass
            self._flush()
            self._write_beat()
            if closing and not self._pending and self._beat is None and self._record is None:
                return
            if closing:
                time.sleep(0.2)  # retry what failed until close's timeout
                continue
            if time.monotonic() >= next_poll:
                self._poll()
                next_poll = time.monotonic() + self.poll_seconds

    def _flush(self) -> None:
        while self._pending:
            kind, item = self._pending[0]
            contribution, extra, after_put, record = item
            try:
                if record is not None:
                    self._put_record(record)
                    self._pending[0] = (kind, (contribution, extra, after_put, None))
                # After the write-ahead record (its claim then reads as an offer not stored,
                # and the ledger still balances), before the offer.
                if self.fenced():
                    self.log.warning(f"offer to round {contribution.round} dropped: attempt "
                                     f"{self.superseded_by} of {self.learner} has replaced attempt "
                                     f"{self.attempt}")
                    self._pending.pop(0)
                    continue
                self.bytes_up += self.store.put_contribution(contribution, extra)
                if after_put is not None:
                    after_put(self.store)
                self.log.info(f"offered fragment {contribution.fragment} to round "
                              f"{contribution.round} ({contribution.steps} steps, "
                              f"{contribution.tokens} tokens, base v{contribution.base_version})")
            except Conflict as err:
                # Already offered to that round (e.g. by this learner before a restart):
                # write-once means the first offer stands; retrying can never succeed.
                self.log.warning(f"offer to round {contribution.round} dropped: {err}")
            except Exception as err:  # noqa: BLE001 - retried; the loop must not die on I/O
                self.log.warning(f"store write failed, will retry: {err!r}")
                return
            self._pending.pop(0)

    def _put_record(self, record: Mapping[str, Any]) -> None:
        """Store an attempt record unless a newer one is stored already: a heartbeat's record
        taken before an offer must not replace that offer's write-ahead record."""
        at = float(record.get("time", 0.0))
        if at < self._record_written_at:
            return
        self.store.put_attempt_record(self.learner, self.attempt, record)
        self._record_written_at = at

    def _write_beat(self) -> None:
        with self._lock:
            beat, self._beat = self._beat, None
            record, self._record = self._record, None
        if record is not None:
            try:
                self._put_record(record)
            except Exception as err:  # noqa: BLE001 - the next heartbeat carries a newer one
                self.log.warning(f"attempt record write failed, will retry: {err!r}")
                with self._lock:
                    self._record = self._record or record
        if beat is None:
            return
        try:
            # Fencing: if a newer attempt of this learner has started (e.g. this one was
            # orphaned by a dead run worker), step aside instead of competing.
            # The write is conditional on the generation read, so a newer attempt's first
            # heartbeat landing in between is never overwritten (it fails here, and the next
            # try reads it and steps aside).
            current, generation = self.store.heartbeat_generation(self.learner)
            if current is not None and current.attempt > self.attempt:
                self.superseded_by = current.attempt
                return
            self.store.put_heartbeat(self.learner, beat, if_generation=generation)
        except Exception as err:  # noqa: BLE001 - the next heartbeat will try again
            self.log.warning(f"heartbeat write failed, will retry: {err!r}")
            with self._lock:
                self._beat = self._beat or beat

    def _leave_request(self) -> dict | None:
        """{"leave": True, reason, ...} if the capacity record says this learner is absent."""
        try:
            record, _ = self.store.capacity(self._standby)
        except RejectedArtifact as err:
            # Only the control plane writes it; a malformed one must not stop training.
            self.log.warning(f"capacity record refused, ignored: {err}")
            return None
        if self.learner not in record.absent:
            return None
        last = next((c for c in reversed(record.changes) if c.learner == self.learner), None)
        return {"leave": True, "reason": (f"capacity reclaimed ({last.by}: {last.reason})"
                                          if last is not None else "capacity reclaimed"),
                "time": last.at if last is not None else None}

    def _forecast(self) -> BudgetForecast | None:
        try:
            return self.store.budget_forecast()
        except RejectedArtifact as err:
            # Only the syncer writes it; a malformed one must not pause training.
            if not self._forecast_refused:
                self.log.warning(f"budget forecast refused, training on: {err}")
                self._forecast_refused = True
            return None

    def _merged_with(self, fragment: int, version: int, meta: StoredMerge
                     ) -> tuple[dict[int, bool], bool]:
        """Round -> whether its merge took this learner's offer, for the versions since the
        last one known (the skipped ones' metadata read too, at most MERGES_LOOKED_BACK), and
        whether that covers every one of them."""
        first = max(self._known[fragment] + 1, version - MERGES_LOOKED_BACK)
        metas = [meta] + [self.store.version_meta(fragment, v) or StoredMerge()
                          for v in range(first, version)]
        out = {}
        for m in metas:
            if m.round is not None:
                out[m.round] = self.learner in m.members
        return out, first == self._known[fragment] + 1 and len(out) == len(metas)

    def _poll(self) -> None:
        try:
            open_round = self.store.latest_open_round()
            stop = self.store.stop_requested()
            leave = self._leave_request()
            forecast = self._forecast()
            arrived = {}
            for p in range(self._num_fragments):
                version = self.store.current_version(p)
                if version is not None and version > self._known[p]:
                    fragment = self.store.load_global(p, version)
                    merged_with, complete = self._merged_with(p, version, fragment.meta)
                    arrived[p] = Arrival(version, fragment.params, fragment.meta.round,
                                         merged_with, complete)
                    self.bytes_down += sum(v.nbytes for v in fragment.params.values())
        except Exception as err:  # noqa: BLE001 - a failed poll is retried next cycle
            # Nothing of it is taken as known: a fragment read before the failure is read
            # again next cycle, never skipped.
            self.log.warning(f"store poll failed, will retry: {err!r}")
            return
        for p, arrival in arrived.items():
            self._known[p] = arrival.version
        with self._lock:
            # Once asked to leave, the learner leaves: a join that follows is for a new attempt
            # (the supervisor launches it once this one has exited).
            before = self._polled
            at = None if forecast is None else forecast.at
            if self._found_at_start is _UNREAD:
                self._found_at_start = at
            # The forecast this process found when it started may be a previous decider's (a
            # run interrupted and resumed, or a budget raised since): only a newer one counts.
            # A live decider writes one at least every few seconds near the end.
            fresh = forecast is not None and at != self._found_at_start
            target = forecast.targets.get(self.learner) if fresh else None
            # A target's age runs from the newest forecast that names it: read again, the
            # same forecast is not news (a decider that died wrote no newer one).
            since = before.target_since if at == before.forecast_at else time.monotonic()
            self._polled = Polled(open_round, stop, before.leave or leave, target, since, at)
            for p, arrival in arrived.items():
                earlier = self._merged.get(p)
                if earlier is not None:   # not taken yet: the merges it saw still count
                    arrival = dataclasses.replace(
                        arrival, merged_with={**earlier.merged_with, **arrival.merged_with},
                        complete=earlier.complete and arrival.complete)
                self._merged[p] = arrival
