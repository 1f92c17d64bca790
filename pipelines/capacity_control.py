"""Learners joining and leaving a running experiment (scavenged capacity), shared by
`diloco capacity`, the `capacity` job in the Dagster UI and the learner supervisor (which
applies a fault tape's learner_join / learner_leave as their round opens).

A change is a record in the store (`diloco_core.capacity`), never a signal to processes:
- join: the learner supervisor launches the learner at its next tick; it starts from the
  current global parameters and a peer's AdamW state (`resources/learner/restore.py`) and
  reads its own data shard, which no other learner reads;
- leave: the learner reads the record at its next poll, stops training, offers its progress to
  the rounds that come (one per fragment, as at STOP), then exits with status "left" and is
  not relaunched. The round controller stops counting it as live at once, so no round waits
  for it; the token ledger books what it processed after its last offer as
  `left_before_offer`.
"""

import time
from collections.abc import Sequence

from diloco_core.capacity import Capacity, CapacityError
from diloco_core.config import ExperimentConfig
from diloco_core.fault_tape import FaultTape
from resources.store.artifact_store import ArtifactStore, Conflict
from resources.store.contention import retries


def current_capacity(store: ArtifactStore, cfg: ExperimentConfig) -> Capacity:
    return store.capacity(cfg.learners.standby_names)[0]


def change_capacity(store: ArtifactStore, cfg: ExperimentConfig, *, join: Sequence[str] = (),
                    leave: Sequence[str] = (), requested_by: str, reason: str = "",
                    now: float | None = None) -> Capacity:
    """Apply the joins, then the leaves, as one conditional write (retried if another change
    landed in between). `CapacityError` naming the learner if any of them cannot be made;
    nothing is written then."""
    if not join and not leave:
        raise CapacityError("nothing to change: name learners to --join or --leave")
    if store.finished() is not None:
        raise CapacityError(f"experiment {store.experiment} has finished")
    if store.stop_requested() is not None or store.stop_request() is not None:
        raise CapacityError(f"experiment {store.experiment} is stopping (its final rounds are "
                            "under way)")
    roster = cfg.learners.learner_names
    latest = store.latest_open_round()
    opened = None if latest is None else latest.round
    for _ in retries():
        record, generation = store.capacity(cfg.learners.standby_names)
        at = time.time() if now is None else now
        for action, names in (("join", join), ("leave", leave)):
            for name in names:
                record = record.change(name, action, roster, at=at, by=requested_by,
                                       reason=reason, round_index=opened,
                                       min_present=cfg.sync.min_quorum)
        try:
            store.put_capacity(record, generation)
            return record
        except Conflict:
            continue    # someone else changed capacity meanwhile: apply ours to theirs
    raise CapacityError("the capacity record kept changing under every attempt; try again")


def describe(record: Capacity, cfg: ExperimentConfig) -> str:
    roster = cfg.learners.learner_names
    present = record.present(roster)
    return (f"{len(present)} of {len(roster)} learners present ({', '.join(present)})"
            + (f"; absent: {', '.join(record.absent)}" if record.absent else ""))


def apply_tape(store: ArtifactStore, cfg: ExperimentConfig, tape: FaultTape | None,
               opened_round: int | None, now: float | None = None) -> list[str]:
    """The tape's capacity changes whose round is open: each applied once (marked fired after
    it took effect, and skipped if the learner is already in that state, so a tick that died
    in between neither loses nor repeats one). Returns a line per change made."""
    if tape is None or opened_round is None:
        return []
    fired = {f.get("id") for f in store.fired_faults()}
    notes = []
    for fault in tape.capacity_changes():
        if fault.at_round > opened_round or fault.id in fired:
            continue
        action = "join" if fault.kind == "learner_join" else "leave"
        record = current_capacity(store, cfg)
        already = (fault.learner in record.absent) == (action == "leave")
        note = f"{fault.id}: {fault.learner} {action}s at round {opened_round}"
        if not already:
            try:
                change_capacity(store, cfg, **{action: [fault.learner]},
                                requested_by=f"fault tape ({fault.id})",
                                reason=f"{fault.kind} at round {fault.at_round}", now=now)
            except CapacityError as err:
                note = f"{fault.id}: not applied ({err})"
        store.mark_fault_fired(fault.id, {"id": fault.id, "kind": fault.kind,
                                          "learner": fault.learner, "round": opened_round,
                                          "time": time.time() if now is None else now})
        notes.append(note)
    return notes
