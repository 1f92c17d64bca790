"""The records of a run's results, typed: held-out evals (each round's, in the store) and the
run summary (what `pipelines.run_summary.build_summary` computes, what the store keeps at
`summary.json`, and what `diloco demo`, `diloco list`, the `run_summary` asset and the
benchmarks read back).

Pydantic models, frozen: `parse_record(kind, raw)` checks every field's type (and drops keys
it does not know), `to_json()` is what is written. The run summary's JSON keeps its groups'
fields at the top level (`RunSummary.from_json` / `to_json`). Every field has a default, so
that a summary written before a field existed still reads; a summary that is not what this
schema says is refused with the field's path (`RunSummaryError`).
"""

from collections.abc import Mapping
from typing import Any, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    def to_json(self) -> dict:
        return self.model_dump(mode="json")


M = TypeVar("M", bound=_Frozen)


class HeldoutEval(_Frozen):
    """One held-out evaluation of the global model (`pipelines.round_eval.evaluate_global`):
    which fragment versions and how many batches it saw, so that it is reused only for
    exactly those."""
    loss: float
    bits_per_byte: float
    sample: str = ""
    versions: tuple[int, ...] = ()
    batches: int = 0


class RoundEval(HeldoutEval):
    """The eval the store keeps for a round (`rounds/{r}/eval.json`); `by`: "syncer" when the
    syncer service made it (the quorum sensor mirrors those into Dagster)."""
    by: str | None = None


class Evals(_Frozen):
    initial: HeldoutEval | None = None
    final: HeldoutEval | None = None


class Distribution(_Frozen):
    median: float | None = None
    p90: float | None = None
    count: int = 0


class RoundEntry(_Frozen):
    """One decided round: its decision, and its merge or why nothing was committed."""
    round: int
    fragment: int
    decided_by: str | None = None
    admitted: tuple[str, ...] = ()
    late: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    final: bool = False
    decided_at: float | None = None
    reason: str | None = None
    merged: bool = False
    not_merged_reason: str | None = None
    rejected: dict[str, str] = Field(default_factory=dict)
    published_at: float | None = None
    merged_by: str | None = None
    quorum_to_publish_seconds: float | None = None
    decision_to_publish_seconds: float | None = None


class Rejection(_Frozen):
    round: int
    learner: str
    reason: str


class LedgerReport(_Frozen):
    """Where every processed token went (`diloco_core.ledger.Ledger.summary`), with the
    offers the merges refused."""
    tokens_processed: float = 0.0
    tokens: dict[str, float] = Field(default_factory=dict)
    merged_fraction: float | None = None
    by_learner: dict[str, dict[str, float]] = Field(default_factory=dict)
    balanced: bool = True
    problems: tuple[str, ...] = ()
    exact: bool = True
    inexact_attempts: tuple[str, ...] = ()
    refused_records: tuple[str, ...] = ()
    reasons: dict[str, str] = Field(default_factory=dict)
    rejections: tuple[Rejection, ...] = ()

    def lost(self) -> dict[str, float]:
        """Tokens per fate other than merged, the fates that lost none left out."""
        return {k: v for k, v in sorted(self.tokens.items()) if v and k != "merged"}


class CapacityChangeReport(_Frozen):
    learner: str
    action: str
    at: float | None = None
    by: str | None = None
    reason: str | None = None
    round: int | None = None


class CapacityReport(_Frozen):
    absent: tuple[str, ...] = ()
    changes: tuple[CapacityChangeReport, ...] = ()


class FiredFault(_Frozen):
    """What an injector recorded of a fault it fired (`resources.chaos.faults`). Learners
    write these in a chaos run: a record whose fields are not of these types is not a fault
    (strict: no string read as a number)."""
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)
    id: str = Field(max_length=200)
    kind: str = Field(max_length=200)
    time: float = Field(ge=0, allow_inf_nan=False)
    learner: str | None = Field(default=None, max_length=200)
    attempt: int | None = None
    step: int | None = None
    round: int | None = None
    phase: str | None = Field(default=None, max_length=200)
    pid: int | None = None


class Rejoin(_Frozen):
    """A learner taken down by a fault: when it was relaunched, and when a merge next
    included it."""
    fault: str
    kind: str
    learner: str
    at: float
    step: int | None = None
    relaunched_at: float | None = None
    back_in_round: int | None = None
    rejoin_seconds: float | None = None
    rounds_missed: int | None = None


class Resilience(_Frozen):
    """Faults fired, rejoins and goodput (`pipelines.resilience.resilience_report`)."""
    faults_fired: dict[str, int] = Field(default_factory=dict)
    faults: tuple[FiredFault, ...] = ()
    rejoins: tuple[Rejoin, ...] = ()
    goodput: float | None = None
    learner_capacity_tokens: float = 0.0


class RunOutcome(_Frozen):
    """What the run produced: rounds, the held-out loss before and after, tokens."""
    experiment: str | None = None
    rounds_opened: int = 0
    rounds_merged: int = 0
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = None
    final_bits_per_byte: float | None = None
    final_sample: str = ""
    tokens: int = 0
    token_budget: int | None = None


class RunTiming(_Frozen):
    """How steadily and how fast rounds were merged, and who decided and merged them."""
    uptime: float | None = None
    merge_latency_seconds: Distribution = Distribution()
    decision_to_publish_seconds: Distribution = Distribution()
    merged_by: dict[str, int] = Field(default_factory=dict)
    decided_by: dict[str, int] = Field(default_factory=dict)


class LearnerAccount(_Frozen):
    """The learners' side: their processes, where each last one started from, idle time and
    bytes sent."""
    learner_idle_fraction: float | None = None
    learners_rejoined: tuple[str, ...] = ()
    learner_attempts: dict[str, int] = Field(default_factory=dict)
    learner_restarted_at: dict[str, float | None] = Field(default_factory=dict)
    learner_status: dict[str, str | None] = Field(default_factory=dict)
    learner_started_from: dict[str, str | None] = Field(default_factory=dict)
    bytes_up: int = 0


# The groups whose fields sit at the top level of the summary's JSON (the layout every reader
# of `summary.json` and `diloco demo --json` knows); the other fields are nested objects.
_FLAT_GROUPS: dict[str, type[_Frozen]] = {
    "outcome": RunOutcome, "timing": RunTiming, "learners": LearnerAccount,
    "resilience": Resilience}


class RunSummary(_Frozen):
    outcome: RunOutcome = RunOutcome()
    timing: RunTiming = RunTiming()
    learners: LearnerAccount = LearnerAccount()
    resilience: Resilience = Resilience()
    ledger: LedgerReport | None = None
    capacity: CapacityReport = CapacityReport()
    evals: Evals = Evals()
    rounds: tuple[RoundEntry, ...] = ()
    # Who wrote it: the syncer service (its name), or the `summarize` run that recorded it as
    # Dagster's `run_summary` asset (`RunRecords.SUMMARY_RECORDED_BY`).
    summarized_by: str | None = None

    @classmethod
    def from_json(cls, raw: Any) -> "RunSummary":
        if not isinstance(raw, Mapping):
            raise SummaryRecordError(f"*: must be an object, got {type(raw).__name__}")
        groups = {name: _validated(kind, {k: raw[k] for k in kind.model_fields if k in raw})
                  for name, kind in _FLAT_GROUPS.items()}
        nested = {k: raw[k] for k in cls.model_fields if k in raw and k not in _FLAT_GROUPS}
        return _validated(cls, {**nested, **groups})

    def to_json(self) -> dict:
        out: dict = {}
        for name in _FLAT_GROUPS:
            out.update(getattr(self, name).to_json())
        out.update(self.model_dump(mode="json", exclude=set(_FLAT_GROUPS)))
        return out


class SummaryRecordError(ValueError):
    """A stored record that is not what its model describes; the message names the field's
    path and the reason."""


def parse_record(kind: type[M], raw: Any) -> M:
    """`kind` from its JSON (`from_json`: its own reading of the layout, where it has one);
    `SummaryRecordError` names the field that is wrong."""
    reader = getattr(kind, "from_json", None)
    return reader(raw) if reader is not None else _validated(kind, raw)


def _validated(kind: type[M], raw: Any) -> M:
    try:
        return kind.model_validate(raw)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        path = ".".join(str(p) for p in first["loc"]) or "*"
        raise SummaryRecordError(f"{path}: {first['msg']}") from None
