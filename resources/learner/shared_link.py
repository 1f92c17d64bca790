"""The store link of a multi-process learner: the leader's `StoreLink`, seen by every process.

Process 0 (the leader) alone runs a `StoreLink` (polls, uploads, heartbeats, attempt records);
the followers never touch the store. Once per loop iteration `sync()` broadcasts what the
leader's link holds at that moment (superseded, stop, the open round, the budget forecast's
pause target, merged fragments and the leader's clock) and every process reads that snapshot,
so all of them take the same decisions at the same iteration. On a follower the writing calls
(offer, heartbeat) do nothing.
"""

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diloco_core.round_records import RoundOpen
from resources.learner.lockstep import Lockstep
from resources.learner.store_link import MERGES_LOOKED_BACK, Arrival, StoreLink

NONE = -1
HEAD = 7    # words before the fragments': superseded, halt, round, fragment, final, clock, target
# Per fragment: arrived, version, merged round, complete, then (round, took this learner's
# offer) pairs of the merges seen on the way (`Arrival`), padded with NONE.
PAIRS = MERGES_LOOKED_BACK + 1
PER_FRAGMENT = 4 + 2 * PAIRS


class SharedLink:
    def __init__(self, link: StoreLink | None, lockstep: Lockstep,
                 fragment_shapes: Sequence[Mapping[str, tuple[tuple[int, ...], Any]]]):
        """`link`: the leader's StoreLink (None on a follower); `fragment_shapes`: per fragment,
        name -> (shape, dtype) of its arrays, what a follower receives a merge into."""
        self._link, self._lockstep = link, lockstep
        self._shapes = list(fragment_shapes)
        self._origin = time.monotonic()
        self.superseded_by: int | None = None
        self.stop: dict | None = None
        self.open_round: RoundOpen | None = None
        self.now = 0.0   # the leader's monotonic clock at the last sync (seconds)
        self.pause_target: int | None = None
        self._merged: dict[int, Arrival] = {}

    @property
    def bytes_up(self) -> int:
        return 0 if self._link is None else self._link.bytes_up

    @property
    def bytes_down(self) -> int:
        return 0 if self._link is None else self._link.bytes_down

    def sync(self) -> None:
        """Take the leader's view for this iteration (a collective: every process calls it)."""
        P = len(self._shapes)
        words = [0] * (HEAD + PER_FRAGMENT * P)
        merged: dict = {}
        if self._link is not None:
            link = self._link
            rnd, stop, superseded = link.open_round, link.stop, link.superseded_by
            merged = link.take_merged()
            # 0: train on; 1: STOP (the run ends); 2: this learner leaves (capacity reclaimed).
            halt = 0 if stop is None else (2 if stop.get("leave") else 1)
            target = link.pause_target
            words[:HEAD] = [NONE if superseded is None else superseded, halt,
                            NONE if rnd is None else rnd.round,
                            0 if rnd is None else rnd.fragment,
                            int(rnd is not None and rnd.final),
                            int((time.monotonic() - self._origin) * 1e6),
                            NONE if target is None else target]
            for p, arrival in merged.items():
                kept = sorted(arrival.merged_with.items())[-PAIRS:]
                pairs = [w for r, took in kept for w in (r, int(took))]
                at = HEAD + PER_FRAGMENT * p
                words[at:at + PER_FRAGMENT] = [
                    1, arrival.version,
                    NONE if arrival.merged_round is None else arrival.merged_round,
                    int(arrival.complete and len(kept) == len(arrival.merged_with)),
                    *pairs, *[NONE] * (2 * PAIRS - len(pairs))]
            self._stop_record = stop
            self._round_record = rnd
        words = self._lockstep.ints(words)
        superseded, has_stop, round_index, fragment, final, now_us, target = words[:HEAD]
        self.superseded_by = None if superseded == NONE else superseded
        self.now = now_us / 1e6
        self.pause_target = None if target == NONE else target
        if self._link is not None:
            self.stop, self.open_round = self._stop_record, self._round_record
        else:
            self.stop = (None if not has_stop else
                         {"reason": "the leader read a leave request", "leave": True}
                         if has_stop == 2 else {"reason": "the leader read a stop record"})
            # The leader's record, as far as the followers need it (its time is the leader's).
            self.open_round = (None if round_index == NONE else
                               RoundOpen(round_index, fragment, 0.0, final=bool(final)))
        for p in range(P):
            at = HEAD + PER_FRAGMENT * p
            arrived, version, merged_round, complete = words[at:at + 4]
            pairs = words[at + 4:at + PER_FRAGMENT]
            merged_with = {pairs[i]: bool(pairs[i + 1]) for i in range(0, len(pairs), 2)
                           if pairs[i] != NONE}
            if not arrived:
                continue
            if self._link is not None:
                values = {k: np.asarray(v, dtype=self._shapes[p][k][1])
                          for k, v in merged[p].values.items()}
            else:
                values = {k: np.zeros(shape, dtype) for k, (shape, dtype)
                          in self._shapes[p].items()}
            values = self._lockstep.arrays(values)
            self._merged[p] = Arrival(version, values,
                                      None if merged_round == NONE else merged_round,
                                      merged_with, bool(complete))

    def take_merged(self) -> dict[int, Arrival]:
        merged, self._merged = self._merged, {}
        return merged

    def fenced(self) -> bool:
        """The leader's `StoreLink.fenced()` (a store read), shared (a collective)."""
        fenced = int(self._link is not None and self._link.fenced())
        return bool(self._lockstep.ints([fenced])[0])

    def offer(self, *args, **kwargs) -> None:
        if self._link is not None:
            self._link.offer(*args, **kwargs)

    def heartbeat(self, *args, **kwargs) -> None:
        if self._link is not None:
            self._link.heartbeat(*args, **kwargs)

    def close(self) -> None:
        if self._link is not None:
            self._link.close()


