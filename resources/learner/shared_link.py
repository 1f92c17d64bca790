"""The store link of a multi-process learner: the leader's `StoreLink`, seen by every process.

Process 0 (the leader) alone runs a `StoreLink` (polls, uploads, heartbeats, attempt records);
the followers never touch the store. Once per loop iteration `sync()` broadcasts what the
leader's link holds at that moment (superseded, stop, the open round, merged fragments and the
leader's clock) and every process reads that snapshot, so all of them take the same decisions
at the same iteration. On a follower the writing calls (offer, heartbeat) do nothing.
"""

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from resources.learner.lockstep import Lockstep
from resources.learner.store_link import StoreLink

NONE = -1


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
        self.open_round: dict | None = None
        self.now = 0.0   # the leader's monotonic clock at the last sync (seconds)
        self._merged: dict[int, tuple[int, dict, int | None]] = {}

    @property
    def bytes_up(self) -> int:
        return 0 if self._link is None else self._link.bytes_up

    @property
    def bytes_down(self) -> int:
        return 0 if self._link is None else self._link.bytes_down

    def sync(self) -> None:
        """Take the leader's view for this iteration (a collective: every process calls it)."""
        P = len(self._shapes)
        words = [0] * (6 + 3 * P)
        merged: dict = {}
        if self._link is not None:
            link = self._link
            rnd, stop, superseded = link.open_round, link.stop, link.superseded_by
            merged = link.take_merged()
            # 0: train on; 1: STOP (the run ends); 2: this learner leaves (capacity reclaimed).
            halt = 0 if stop is None else (2 if stop.get("leave") else 1)
            words[:6] = [NONE if superseded is None else superseded, halt,
                         NONE if rnd is None else int(rnd["round"]),
                         0 if rnd is None else int(rnd["fragment"]),
                         int(bool(rnd and rnd.get("final"))),
                         int((time.monotonic() - self._origin) * 1e6)]
            for p, (version, _, merged_round) in merged.items():
                words[6 + 3 * p:9 + 3 * p] = [1, version,
                                              NONE if merged_round is None else merged_round]
            self._stop_record = stop
            self._round_record = rnd
        words = self._lockstep.ints(words)
        superseded, has_stop, round_index, fragment, final, now_us = words[:6]
        self.superseded_by = None if superseded == NONE else superseded
        self.now = now_us / 1e6
        if self._link is not None:
            self.stop, self.open_round = self._stop_record, self._round_record
        else:
            self.stop = (None if not has_stop else
                         {"reason": "the leader read a leave request", "leave": True}
                         if has_stop == 2 else {"reason": "the leader read a stop record"})
            self.open_round = (None if round_index == NONE else
                               {"round": round_index, "fragment": fragment,
                                "final": bool(final)})
        for p in range(P):
            arrived, version, merged_round = words[6 + 3 * p:9 + 3 * p]
            if not arrived:
                continue
            if self._link is not None:
                values = {k: np.asarray(v, dtype=self._shapes[p][k][1])
                          for k, v in merged[p][1].items()}
            else:
                values = {k: np.zeros(shape, dtype) for k, (shape, dtype)
                          in self._shapes[p].items()}
            values = self._lockstep.arrays(values)
            self._merged[p] = (version, values, None if merged_round == NONE else merged_round)

    def take_merged(self) -> dict[int, tuple[int, dict, int | None]]:
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


