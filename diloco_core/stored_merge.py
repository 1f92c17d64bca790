"""A round's merge as the store keeps it, typed and validated like the round records.

Apart from `round_records` so that the simulator's import closure (which keys the stored
quality results, `benchmarks/quality/code_identity.py`) does not reach it: the simulator keeps
its merges in memory (`diloco_core.syncer.MergeRecord`); this is their stored form.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from diloco_core.round_records import (
    _NAMES,
    _TIME,
    MAX_ITEMS,
    MAX_TEXT,
    Check,
    _bool,
    _int,
    _list,
    _map,
    _num,
    _optional,
    _Record,
    _str,
)


@dataclass(frozen=True)
class StoredMerge(_Record):
    """A round's merge as the store keeps it: the `meta` of the global version it published,
    or the record of a decided round that committed nothing (`merged` false). Who was merged
    with what weight and credit, who was refused and why, the decision's times and the
    publication's. Version 0 of each fragment carries `initial` and no round. The decision's
    own fields (its times, who decided, who was late) are in its record, not copied here."""

    KIND: ClassVar[str] = "merge"
    CHECKS: ClassVar[dict[str, Check]] = {
        "round": _optional(_int()), "fragment": _optional(_int(hi=MAX_ITEMS)),
        "initial": _bool, "merged": _bool,
        "reason": _str(64 * MAX_TEXT), "members": _NAMES, "weights": _list(_num()),
        "tokens": _list(_int()), "steps": _list(_int()), "rejected": _map(_str(MAX_TEXT)),
        "outer_grad_norms": _list(_num()), "merged_norm": _optional(_num()),
        "update_norm": _optional(_num()), "bytes_in": _int(), "mean_cosine": _optional(_num()),
        "clipped": _map(_str(MAX_TEXT)), "merged_by": _str(),
        "finite": _bool, "merge_seconds": _optional(_num(0.0)),
        "published_at": _optional(_TIME)}

    round: int | None = None
    fragment: int | None = None
    initial: bool = False
    merged: bool = False
    reason: str = ""
    members: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()        # credited, as `steps`: what the syncer corroborated
    steps: tuple[int, ...] = ()
    rejected: Mapping[str, str] = field(default_factory=dict)
    outer_grad_norms: tuple[float, ...] = ()
    # None: no merge (version 0), or not a finite number (a merge whose parameters came out NaN
    # or Inf is recorded, not committed, and JSON has no NaN).
    merged_norm: float | None = None
    update_norm: float | None = None
    bytes_in: int = 0
    mean_cosine: float | None = None
    clipped: Mapping[str, str] = field(default_factory=dict)
    merged_by: str = "run"
    finite: bool = True
    merge_seconds: float | None = None
    published_at: float | None = None

    def latency(self, since: float | None) -> float | None:
        """Seconds from `since` (the decision's quorum or decision time) to the publication,
        None when either is unknown."""
        if not self.published_at or not since:
            return None
        return self.published_at - since


def as_stored_merge(record: "StoredMerge | Mapping") -> StoredMerge:
    """The record as a `StoredMerge`: a mapping is validated (`RecordError` names the field)."""
    return record if isinstance(record, StoredMerge) else StoredMerge.from_json(record)
