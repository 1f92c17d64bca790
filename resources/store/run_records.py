"""The run's lifecycle records: config, summary, fault tape and fired faults, STOP, capacity, token
budget, FINISHED, the syncer lease, retention, and the ACTIVE experiment.

Part of `ArtifactStore` (`artifact_store.py`), which composes the record families; keys in
`layout.py`.
"""

import contextlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from diloco_core.budget_forecast import BudgetForecast
from diloco_core.capacity import Capacity
from diloco_core.round_records import MAX_INT, RecordError
from resources.store import layout
from resources.store.blobs import BlobNotFound, BlobStore, ListingTooLong, PreconditionFailed
from resources.store.contention import retries
from resources.store.lease_record import LeaseRecord
from resources.store.names import check_name
from resources.store.store_base import (
    Conflict,
    RejectedArtifact,
    StoreBase,
    _json_bytes,
    _roster_of,
)
from resources.store.summary_records import RunSummary

# Listings of faults/fired/ are bounded: learners write there in a chaos run.
MAX_FIRED_LISTED = 10_000        # objects under faults/fired/


class RunRecords(StoreBase):
    """The experiment-wide records the control plane writes."""

    def put_config(self, config: Mapping[str, Any]) -> None:
        self._write_once(layout.config(self.experiment), _json_bytes(dict(config)))

    def get_config(self) -> dict | None:
        config = self._read_json(layout.config(self.experiment))
        if config is not None and self._roster is None:
            self._roster = _roster_of(config)   # write-once: what bounds listings per learner
        return config

    # The summary's `summarized_by` once the `summarize` run has recorded it as Dagster's
    # `run_summary` asset (the syncer service writes it first, under its own name).
    SUMMARY_RECORDED_BY = "summarize"

    def put_summary(self, summary: RunSummary) -> None:
        # The one object that is rewritten: the latest summary of a (possibly resumed) run.
        self.blobs.write(layout.summary(self.experiment), _json_bytes(summary.to_json()))

    def get_summary(self) -> RunSummary | None:
        """The run's summary, None before one is written; `RejectedArtifact` names the field
        of a stored summary that is not what `RunSummary` describes."""
        return self._read_model(layout.summary(self.experiment), RunSummary)

    def put_fault_tape(self, tape: Mapping[str, Any]) -> None:
        self._write_once(layout.fault_tape(self.experiment), _json_bytes(dict(tape)))

    def get_fault_tape(self) -> dict | None:
        return self._read_json(layout.fault_tape(self.experiment))

    def mark_fault_fired(self, fault_id: str, record: Mapping[str, Any]) -> bool:
        """Record that a fault fires; False if it already fired (so it never fires twice,
        e.g. when a learner relaunched from an earlier checkpoint reaches the step again)."""
        try:
            self.blobs.write(layout.fired_fault(self.experiment, fault_id) + ".json",
                             _json_bytes(dict(record)), if_generation=0)
        except PreconditionFailed:
            return False
        return True

    def fired_faults(self) -> list[dict]:
        """The fired-fault records, in time order. In a chaos run learners write them too: an
        unreadable or oversized one is left out, and past `MAX_FIRED_LISTED` objects none is
        read (`listing_refusals` says why; `mark_fault_fired` still fires each fault once)."""
        prefix = layout.fired_prefix(self.experiment)
        try:
            keys = self.blobs.list(prefix, limit=MAX_FIRED_LISTED)
        except ListingTooLong:
            self._refuse_listing(prefix, f"more than {MAX_FIRED_LISTED} objects; none read")
            return []
        out = []
        for key in keys:
            with contextlib.suppress(RejectedArtifact):
                record = self._read_bounded_json(key, 64 * 2**10)
                if record is not None:
                    out.append(record)

        def when(record: dict) -> float:
            t = record.get("time")
            ok = isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t)
            return float(t) if ok else 0.0

        return sorted(out, key=when)

    def put_budget_forecast(self, forecast: BudgetForecast) -> None:
        """The syncer's latest forecast (`diloco_core/budget_forecast.py`): rewritten, at most
        once a second, only near the end of the budget."""
        self.blobs.write(layout.budget_forecast(self.experiment), _json_bytes(forecast.to_json()))

    def budget_forecast(self) -> BudgetForecast | None:
        """The latest forecast, None before one is written; `RejectedArtifact` if malformed."""
        return self._read_typed(layout.budget_forecast(self.experiment), BudgetForecast)

    def request_stop(self, record: Mapping[str, Any]) -> None:
        self._write_once(layout.stop(self.experiment), _json_bytes(dict(record)))

    def stop_requested(self) -> dict | None:
        return self._read_json(layout.stop(self.experiment))

    def capacity(self, standby: Sequence[str] = ()) -> tuple[Capacity, int]:
        """Which learners are absent now, and the generation the record was read at for a
        conditional `put_capacity` (0: none written yet; then it is the launch state, the
        `standby` learners absent). `RejectedArtifact` if the stored record is malformed."""
        key = layout.capacity(self.experiment)
        for _ in range(10):
            info = self.blobs.info(key)
            if info is None:
                return Capacity.at_launch(standby), 0
            raw = self._read_json(key)
            again = self.blobs.info(key)
            if raw is None or again is None or again.generation != info.generation:
                continue   # moved while read: read again
            try:
                return Capacity.from_json(raw), info.generation
            except RecordError as err:
                raise RejectedArtifact(key, str(err)) from None
        raise Conflict("the capacity record keeps changing")

    def put_capacity(self, record: Capacity, if_generation: int) -> None:
        """Write the capacity record only if it is still at `if_generation` (`Conflict`
        otherwise): two operators (or an operator and a fault tape) changing capacity at once
        never lose one another's change."""
        try:
            self.blobs.write(layout.capacity(self.experiment), _json_bytes(record.to_json()),
                             if_generation=if_generation)
        except PreconditionFailed:
            raise Conflict("the capacity record was changed concurrently") from None

    def token_budget(self, configured: int) -> int:
        """The run's token budget: the config's, or a larger one set on resume
        (`raise_token_budget`). A malformed record is refused (`RejectedArtifact`)."""
        raw = self._read_json(layout.budget(self.experiment))
        if raw is None:
            return configured
        budget = raw.get("token_budget") if isinstance(raw, dict) else None
        if not isinstance(budget, int) or isinstance(budget, bool) or not 0 < budget <= MAX_INT:
            raise RejectedArtifact(layout.budget(self.experiment),
                                   f"token_budget must be a positive integer, got {budget!r}")
        return max(configured, budget)

    def raise_token_budget(self, budget: int, configured: int, record: Mapping[str, Any]
                           ) -> int:
        """Raise the run's token budget to `budget` if that is larger than the one in force
        (the control plane, when `train` resumes a run with a larger one); returns the budget
        in force after. Conditional on the record read: two raises at once both count."""
        key = layout.budget(self.experiment)
        for _ in retries():
            info = self.blobs.info(key)
            current = self.token_budget(configured)
            if budget <= current:
                return current
            try:
                self.blobs.write(key, _json_bytes({**record, "token_budget": budget}),
                                 if_generation=0 if info is None else info.generation)
                return budget
            except PreconditionFailed:
                continue
        raise Conflict("the token budget keeps changing")

    def put_stop_request(self, record: Mapping[str, Any]) -> bool:
        """An operator asks to end the run before its budget (`diloco stop`, the `stop` job).
        The round controller turns it into STOP at its next tick, so the run ends as at the
        budget: final rounds, then the summary. Write-once: False if one was already made."""
        try:
            self._write_once(layout.stop_request(self.experiment), _json_bytes(dict(record)))
        except Conflict:
            return False
        return True

    def stop_request(self) -> dict | None:
        return self._read_json(layout.stop_request(self.experiment))

    def mark_finished(self, record: Mapping[str, Any]) -> None:
        """The run's final rounds are decided and published (write-once; the first writer's
        record stands when the syncer and the sensor fallback both get there)."""
        with contextlib.suppress(Conflict):
            self._write_once(layout.finished(self.experiment), _json_bytes(dict(record)))

    def finished(self) -> dict | None:
        return self._read_json(layout.finished(self.experiment))

    def get_syncer_lease(self) -> LeaseRecord | None:
        """The syncer's lease record as observers see it (`resources.store.lease`); one that
        cannot be read reads as a record of unknown holder and status."""
        try:
            raw = self._read_json(layout.syncer_lease(self.experiment))
        except RejectedArtifact:
            raw = {}
        return None if raw is None else LeaseRecord.from_json(raw)

    def get_retention(self) -> dict | None:
        """How far retention got (written by the syncer), or None before its first pass."""
        try:
            return self._read_json(layout.retention(self.experiment))
        except RejectedArtifact:
            return None   # unreadable: retention starts over, which only re-checks

    def put_retention(self, record: Mapping[str, Any]) -> None:
        self.blobs.write(layout.retention(self.experiment), _json_bytes(record))


def set_active_experiment(blobs: BlobStore, experiment: str | None) -> None:
    """Point the sensors at `experiment` (None: no experiment is running)."""
    if experiment is not None:
        check_name("experiment", experiment)
    blobs.write(layout.ACTIVE, _json_bytes({"experiment": experiment}))


def active_experiment(blobs: BlobStore) -> str | None:
    try:
        value = json.loads(blobs.read(layout.ACTIVE))
    except BlobNotFound:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RejectedArtifact(layout.ACTIVE, f"not valid JSON: {err}") from None
    name = value.get("experiment") if isinstance(value, dict) else None
    return None if name is None else check_name("experiment", name)
