"""The syncer's lease record (`syncer/LEASE`), typed: what the holder writes and what the
takers and observers (`diloco status`, the quorum sensor, the supervisor, the demo) read.

Read leniently: the record is moved only by compare-and-swap, but a broken or foreign write
must neither stop a new syncer from taking the lease over nor an observer from reporting, so
a field that is missing or malformed reads as unknown (None) or its initial value, never as an
error. (`resources.store.lease` has the protocol.)
"""

from dataclasses import asdict, dataclass
from typing import Any

from diloco_core.round_records import finite_float


def _count(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def _text(value: Any, limit: int = 256) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= limit else None


@dataclass(frozen=True)
class LeaseRecord:
    """`holder`: "host:pid:nonce" of the process that holds it; `attempt`: the syncer attempt
    (None: unknown); `epoch`: bumped by every takeover; `beat`: bumped by every renewal;
    `status`: "syncing" or "released"; `time`: the holder's wall clock at its last write;
    `since`: when it took the lease; `pid`: the holder's process on its host; `name`: who
    holds it as its records say ("syncer-a<n>" or "syncer-a<n>-standby"; older records lack
    it, and `since`)."""
    holder: str = ""
    attempt: int | None = None
    epoch: int = 0
    beat: int = 0
    status: str = "unknown"
    time: float | None = None
    pid: int | None = None
    name: str | None = None
    since: float | None = None

    @classmethod
    def from_json(cls, raw: Any) -> "LeaseRecord":
        raw = raw if isinstance(raw, dict) else {}
        return cls(holder=_text(raw.get("holder")) or "", attempt=_count(raw.get("attempt")),
                   epoch=_count(raw.get("epoch")) or 0, beat=_count(raw.get("beat")) or 0,
                   status=_text(raw.get("status"), 64) or "unknown",
                   time=finite_float(raw.get("time")), pid=_count(raw.get("pid")),
                   name=_text(raw.get("name"), 128), since=finite_float(raw.get("since")))

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def holder_name(self) -> str:
        """Who holds it, for people: its own name, else its attempt's."""
        if self.name:
            return self.name
        return "syncer" if self.attempt is None else f"syncer-a{self.attempt}"

    @property
    def standby(self) -> bool:
        """Held by the warm standby that took over from a dead syncer."""
        return self.holder_name.endswith("-standby")

    @property
    def marker(self) -> str:
        """What changes on every renewal, release and takeover (observers watch it move on
        their own clock: clocks of different machines are never compared)."""
        return f"{self.epoch}|{self.beat}|{self.status}"
