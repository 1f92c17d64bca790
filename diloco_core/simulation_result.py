"""What a simulated run reports: held-out loss over tokens, goodput, uptime, bytes, merges."""

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from diloco_core.syncer import MergeRecord


@dataclass
class LearnerStats:
    name: str
    steps: int = 0
    tokens: int = 0
    busy_seconds: float = 0.0      # completed inner steps
    idle_seconds: float = 0.0      # up but waiting for a round or a merged fragment
    down_seconds: float = 0.0      # failed, not yet rejoined
    lost_seconds: float = 0.0      # partial steps cut off by a failure or by the end of the run
    absent_seconds: float = 0.0    # not part of the run (scavenged capacity not there yet or gone)
    closing_seconds: float = 0.0   # after STOP: up, answering the final rounds until the end
    train_loss: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Rejoin:
    learner: str
    down_at: float
    up_at: float
    first_merge_at: float | None   # first merge that admitted it after rejoining


@dataclass
class SimulationResult:
    method: str
    wall_seconds: float                       # fake-clock duration of the run
    tokens_processed: int
    # {"time", "tokens", "round", "loss"} and "bits_per_byte" (text) or "accuracy" (digits)
    evals: list[dict]
    merges: list[MergeRecord]
    learners: list[LearnerStats]
    uptime: float                             # share of time the global model was advancing
    bytes_up: int                             # learner -> syncer (encoded outer gradients)
    bytes_down: int                           # syncer -> learners (fp32 merged fragments)
    merged_token_fraction: float = 1.0        # share of processed tokens that reached a merge
    rejoins: list[Rejoin] = field(default_factory=list)
    merge_times: dict[int, float] = field(default_factory=dict)   # round -> fake-clock seconds
    final_params: dict | None = field(default=None, repr=False)

    @property
    def goodput(self) -> float:
        """Useful compute / allocated compute: completed step time over M x wall time."""
        allocated = len(self.learners) * self.wall_seconds
        return sum(s.busy_seconds for s in self.learners) / allocated if allocated else 0.0

    @property
    def final_loss(self) -> float:
        return self.evals[-1]["loss"] if self.evals else float("nan")

    def summary(self) -> dict:
        """JSON-safe figures (no arrays)."""
        merged = [m for m in self.merges if m.merged]
        return {
            "method": self.method,
            "final_heldout_loss": self.final_loss,
            "final_bits_per_byte": self.evals[-1].get("bits_per_byte") if self.evals else None,
            "final_accuracy": self.evals[-1].get("accuracy") if self.evals else None,
            "tokens_processed": self.tokens_processed,
            "wall_seconds": self.wall_seconds,
            "goodput": self.goodput,
            "uptime": self.uptime,
            "merged_token_fraction": self.merged_token_fraction,
            "rounds_merged": len(merged),
            "mean_members_per_merge": float(np.mean([len(m.members) for m in merged]))
            if merged else 0.0,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "bytes_up_per_token": self.bytes_up / max(self.tokens_processed, 1),
            "rejoins": [dataclasses.asdict(r) for r in self.rejoins],
            "learners": [{k: v for k, v in dataclasses.asdict(s).items() if k != "train_loss"}
                         for s in self.learners],
            "evals": self.evals,
        }
