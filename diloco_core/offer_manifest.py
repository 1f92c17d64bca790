"""The manifest of a learner's offer, typed and validated like the round records.

A learner writes it beside its payload; the syncer, the merge and every observer read it back.
It is untrusted: `OfferManifest.from_json` checks every field (type, bounds, the payload
object's name and checksum, each tensor's encoding, shape and block size) and raises
`RecordError` naming the field, before any byte of the payload is read. Whether the manifest is
this learner's offer to this round is the store's check (it knows the key it read).

Apart from `round_records` so that the simulator's import closure (which keys the stored
quality results, `benchmarks/quality/code_identity.py`) does not reach it: the simulator hands
contributions over in memory.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from diloco_core.config import ENCODINGS
from diloco_core.round_records import (
    MAX_INT,
    MAX_TEXT,
    Check,
    RecordError,
    _bool,
    _int,
    _list,
    _map,
    _num,
    _Record,
    _str,
)

FORMAT = 1
MAX_TENSORS = 100_000
MAX_TENSOR_RANK = 16     # dimensions of one tensor (models here have at most 4)
MAX_PARAM_NAME = 1024
_OBJECT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def _one_of(allowed: tuple) -> Check:
    def check(v):
        if v not in allowed:
            raise ValueError(f"must be one of {list(allowed)}, got {str(v)[:40]!r}")
        return v
    return check


def _object_name(v):
    if not isinstance(v, str) or not _OBJECT_NAME.fullmatch(v):
        raise ValueError(f"must be a plain file name, got {str(v)[:80]!r}")
    return v


def field_reason(err: RecordError) -> str:
    """`field: reason`, with a nested record's path joined on (`objects.delta.name: ...`)."""
    if err.field == "*":
        return err.reason
    joined = err.reason.startswith((".", "["))
    return f"{err.field}{'' if joined else ': '}{err.reason}"


def _record(kind: type["_Record"], limit: int | None = None) -> Check:
    """A nested record (or, with `limit`, a non-empty list of them); an error names the path
    into it (`objects.delta.name: ...`, `tensors[3].shape: ...`)."""
    def one(v, where: str):
        try:
            return kind.from_json(v)
        except RecordError as err:
            inner = field_reason(err)
            path = where + ("" if err.field == "*" else ".")
            raise ValueError(f"{path}{inner}" if path else inner) from None

    def check(v):
        if limit is None:
            return one(v, "")
        if not isinstance(v, list | tuple) or not v:
            raise ValueError("no tensors: must be a non-empty list")
        if len(v) > limit:
            raise ValueError(f"{len(v)} entries (at most {limit})")
        return tuple(one(x, f"[{i}]") for i, x in enumerate(v))
    return check


@dataclass(frozen=True)
class TensorEntry(_Record):
    """One tensor of the offered delta: how it is encoded in the payload."""

    KIND: ClassVar[str] = "tensor"
    CHECKS: ClassVar[dict[str, Check]] = {
        "name": _str(MAX_PARAM_NAME), "shape": _list(_int(), MAX_TENSOR_RANK),
        "encoding": _one_of(ENCODINGS), "block_size": _int(lo=1), "scales": _bool}

    name: str
    shape: tuple[int, ...]
    encoding: str
    block_size: int
    scales: bool


@dataclass(frozen=True)
class PayloadObject(_Record):
    """The payload object a manifest vouches for: its file name beside the manifest, size,
    SHA-256 and the arrays it holds (checked against the bytes when it is decoded)."""

    KIND: ClassVar[str] = "object"
    CHECKS: ClassVar[dict[str, Check]] = {
        "name": _object_name, "size": _int(), "sha256": _str(64),
        "dtypes": _map(_str(32), 2 * MAX_TENSORS),
        "shapes": _map(_list(_int(), MAX_TENSOR_RANK), 2 * MAX_TENSORS)}

    name: str
    size: int
    sha256: str
    dtypes: Mapping[str, str] = field(default_factory=dict)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**super().to_json(), "shapes": {k: list(v) for k, v in self.shapes.items()}}


@dataclass(frozen=True)
class PayloadObjects(_Record):
    KIND: ClassVar[str] = "objects"
    CHECKS: ClassVar[dict[str, Check]] = {"delta": _record(PayloadObject)}

    delta: PayloadObject


@dataclass(frozen=True)
class OfferManifest(_Record):
    """A learner's offer of one fragment to one round: who, on which base version, what it
    claims (tokens, steps: claims the syncer corroborates), the payload and its tensors, and
    `extra`, free-form JSON for observers (its train loss, its claim for the token ledger)."""

    KIND: ClassVar[str] = "contribution"
    CHECKS: ClassVar[dict[str, Check]] = {
        "format": _one_of((FORMAT,)), "kind": _one_of(("contribution",)),
        "experiment": _str(), "learner": _str(), "round": _int(),
        "fragment": _int(hi=MAX_INT), "base_version": _int(), "tokens": _int(),
        "steps": _int(), "learner_step": _int(), "clock": _num(),
        "encoding": _list(_one_of(ENCODINGS)), "nbytes": _int(),
        "tensors": _record(TensorEntry, MAX_TENSORS), "objects": _record(PayloadObjects),
        "extra": _map(lambda v: v, MAX_TEXT)}

    learner: str
    round: int
    fragment: int
    base_version: int
    tokens: int
    steps: int
    learner_step: int
    clock: float
    tensors: tuple[TensorEntry, ...]
    objects: PayloadObjects
    format: int = FORMAT
    kind: str = "contribution"
    experiment: str = ""
    encoding: tuple[str, ...] = ()
    nbytes: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def payload(self) -> PayloadObject:
        return self.objects.delta

    def to_json(self) -> dict:
        return {**super().to_json(), "tensors": [t.to_json() for t in self.tensors],
                "objects": {"delta": self.objects.delta.to_json()}}
