"""What the quorum sensor shows in Dagster while the syncer service runs the rounds.

The syncer decides and merges in its own process and writes everything to the store; this
reads the store and says what Dagster should record, without writing anything to the store:
round partitions for the rounds opened, a `learner_update` event per offer, a
`global_params` materialization (and its checks) per round the syncer merged, a
`heldout_eval` one per eval it stored, and the end of the run. Rounds are mirrored in order,
at most `MAX_ROUNDS_PER_TICK` a tick, so a sensor that fell behind (a daemon restart) catches
up over a few ticks instead of timing out on one. Rounds merged by fallback merge runs are
not mirrored: those runs materialized them.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import pydantic

from diloco_core.config import ExperimentConfig
from diloco_core.round_records import RoundDecision
from diloco_core.stored_merge import StoredMerge
from diloco_core.syncer_machine import LATE_WINDOW
from pipelines.offer_summary import OfferSummary, describe_offer
from resources.store.artifact_store import ArtifactStore
from resources.store.summary_records import HeldoutEval, RoundEval

MAX_ROUNDS_PER_TICK = 64


@dataclass
class MirrorResult:
    state: dict
    opened: list[int] = field(default_factory=list)
    offers: list[OfferSummary] = field(default_factory=list)
    # (round, merge record, decision, version) of rounds the syncer merged or refused
    merges: list[tuple[int, StoredMerge, RoundDecision, int]] = field(default_factory=list)
    # (round, eval, the eval before it) of evals the syncer stored
    evals: list[tuple[int, RoundEval, HeldoutEval | None]] = field(default_factory=list)
    finished: bool = False
    # Whether this tick mirrored any round's fate: at most MAX_ROUNDS_PER_TICK are, so a
    # mirror that fell behind is still catching up while this is true.
    fates_moved: bool = False


def fresh_mirror() -> dict:
    return {"opened": -1, "fates": 0, "offers_from": 0, "offers": {}, "evals": -1,
            "last_eval": None}


def round_fate(store: ArtifactStore, round_index: int, decision: RoundDecision,
               after: int | None = None
               ) -> tuple[str, StoredMerge | None, int | None, int | None]:
    """("merged", version meta, version), ("not_merged", record, None), ("skipped", None,
    None) for a round whose fragment moved past it without it, or ("pending", None, None);
    then the version the search for this fragment's next round can start after.

    `after`: the version up to which every version of the fragment holds an earlier round,
    from the search for its round before (`next_round_commit`); the search then goes forward
    from it, one read per version over a whole catch-up. Without it (a cursor from before
    it) the search walks back from the current version."""
    fragment = decision.fragment
    current = store.current_version(fragment)
    if current is None:
        return "pending", None, None, after
    below, version, meta = store.next_round_commit(fragment, round_index, current, after)
    if meta is not None and meta.round == round_index:
        return "merged", meta, version, version
    refused = store.get_round_not_merged(round_index)
    if refused is not None:
        return "not_merged", refused, None, below
    if version is not None:     # a version of a later round: the fragment moved past it
        return "skipped", None, None, below
    return "pending", None, None, below


def mirror_tick(store: ArtifactStore, cfg: ExperimentConfig, state: dict | None) -> MirrorResult:
    state = {**fresh_mirror(), **(state or {})}
    result = MirrorResult(state)
    # One read per round and tick: offers, fates and evals all ask whether a round is decided.
    decision_of = functools.cache(store.get_decision)
    latest = store.latest_open_round()
    last = latest.round if latest else -1
    if last > state["opened"]:
        first = max(state["opened"] + 1, last - MAX_ROUNDS_PER_TICK + 1)
        result.opened = list(range(first, last + 1))
        state["opened"] = last
    _offers(store, cfg, state, result, last, decision_of)
    fates_before = state["fates"]
    _fates(store, state, result, last, decision_of)
    result.fates_moved = state["fates"] != fates_before
    _evals(store, state, result, last, decision_of)
    result.finished = store.finished() is not None
    return result


def _offers(store: ArtifactStore, cfg: ExperimentConfig, state: dict, result: MirrorResult,
            last: int, decision_of: Callable[[int], RoundDecision | None]) -> None:
    """Offers of every round not yet closed to offers: a round is closed once it is decided
    and LATE_WINDOW rounds older than the newest (later offers to it are not reported, as
    with the sensor's own watch window)."""
    seen = {int(k): set(v) for k, v in state["offers"].items()}
    start = max(state["offers_from"], last - MAX_ROUNDS_PER_TICK + 1, 0)
    closed_until = start
    for index in range(start, last + 1):
        decided = decision_of(index) is not None
        known = seen.setdefault(index, set())
        for learner in store.list_contributions(index):
            if learner not in known:
                known.add(learner)
                result.offers.append(describe_offer(store, cfg, index, learner, decided))
        if index == closed_until and decided and index < last - LATE_WINDOW:
            closed_until = index + 1
    state["offers_from"] = closed_until
    state["offers"] = {str(k): sorted(v) for k, v in seen.items() if k >= closed_until}


def _fates(store: ArtifactStore, state: dict, result: MirrorResult, last: int,
           decision_of: Callable[[int], RoundDecision | None]) -> None:
    k = state["fates"]
    # Per fragment, the version up to and including which every version holds a round
    # before k. A mirror starting at round 0 starts every fragment's search at version 0 (the
    # initial parameters); a cursor from before this record has none, so each fragment's first
    # search walks back from its current version (forward from 0 would read its whole history).
    searched = state.setdefault("searched", {"default": 0} if k == 0 else {})
    for _ in range(MAX_ROUNDS_PER_TICK):
        if k > last:
            break
        decision = decision_of(k)
        if decision is None:
            break
        if not decision.members:
            k += 1   # nobody to merge (a final round nobody offered to)
            continue
        key = str(decision.fragment)
        fate, record, version, below = round_fate(store, k, decision,
                                                 searched.get(key, searched.get("default")))
        if below is not None:
            searched[key] = below
        if fate == "pending":
            break
        if record is not None and record.merged_by.startswith("syncer"):
            if version is None:
                version = store.current_version(decision.fragment) or 0
            result.merges.append((k, record, decision, version))
        k += 1
    state["fates"] = k


def _previous_eval(state: dict | None) -> HeldoutEval | None:
    """The cursor's last eval; None if there is none, or it was written before the cursor
    kept its batches."""
    try:
        return None if state is None else HeldoutEval.model_validate(state)
    except pydantic.ValidationError:
        return None


def _evals(store: ArtifactStore, state: dict, result: MirrorResult, last: int,
           decision_of: Callable[[int], RoundDecision | None]) -> None:
    # The syncer stores an eval once, under the newest round it knows of, after that tick's
    # merges: every round before the newest decided one has its eval by now, or never will.
    decided = last if last >= 0 and decision_of(last) is not None else last - 1
    top = decided - 1
    start = max(state["evals"] + 1, last - MAX_ROUNDS_PER_TICK + 1, 0)
    for index in range(start, last + 1):
        evaluation = store.get_eval(index)
        if evaluation is None:
            continue
        top = max(top, index)
        if evaluation.by == "syncer":
            result.evals.append((index, evaluation, _previous_eval(state.get("last_eval"))))
        # What the next eval's regression check compares with: its loss and its batches (an
        # eval on other batches is another measurement, and is not compared).
        state["last_eval"] = evaluation.model_copy(update={"sample": ""}).to_json()
    state["evals"] = max(state["evals"], top)
