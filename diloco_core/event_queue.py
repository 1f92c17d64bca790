"""The simulator's event queue on its fake clock."""

import heapq


class EventQueue:
    """The event queue: (time, sequence) order, so events at one instant keep the order they
    were queued in, with at most one syncer tick queued per instant."""

    def __init__(self):
        self.heap: list = []
        self.seq = 0
        self.ticks: set[float] = set()

    def __bool__(self) -> bool:
        return bool(self.heap)

    def push(self, time: float, kind: str, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, kind, payload))

    def pop(self) -> tuple[float, str, tuple]:
        time, _, kind, payload = heapq.heappop(self.heap)
        return time, kind, payload

    def clear(self) -> None:
        self.heap.clear()

    def tick_at(self, time: float) -> None:
        if time not in self.ticks:
            self.ticks.add(time)
            self.push(time, "tick")

    def ticked(self, time: float) -> None:
        self.ticks.discard(time)
