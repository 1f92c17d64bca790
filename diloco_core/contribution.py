"""A learner's contribution to one round: its encoded outer gradient for one fragment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # JAX-free at import: the Dagster code location loads this module
    from diloco_core.compression import Encoded


@dataclass(frozen=True)
class Contribution:
    """What a learner offers the syncer for fragment `fragment` in round `round`.

    `delta` is anchor - theta per tensor (the learner's own outer gradient against the global
    version `base_version` it last received), encoded for the wire. `tokens` and `steps` are
    counted since the learner last received this fragment; they set its merge weight.
    """

    learner: str
    fragment: int
    round: int
    base_version: int
    tokens: int
    steps: int
    learner_step: int
    clock: float
    delta: dict[str, Encoded]

    @property
    def nbytes(self) -> int:
        """Exact payload bytes on the wire (values and scales, not metadata)."""
        return sum(e.nbytes for e in self.delta.values())
