"""The merge of one round against the store: what the `global_params` asset runs.

Reads the quorum decision the sensor committed for the round, loads the admitted contributions
one by one (each verified by the store: size, checksum, shapes, encoding; refused ones keep
their reason), merges them into the round's fragment with the core merge (validation, norm
screening, token weights, RDA, outer Nesterov), and commits the new version through the
store's compare-and-swap pointer. A retried run of a round that already committed returns that
commit's record instead of merging twice. Non-finite merged parameters are never committed.
"""

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import optax

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_from_mapping
from diloco_core.contribution import Contribution
from diloco_core.fragments import FragmentPlan, plan_fragments
from diloco_core.model import abstract_params, is_embedding
from diloco_core.outer import outer_optimizer_for
from diloco_core.round_records import RoundDecision
from diloco_core.stored_merge import StoredMerge
from diloco_core.syncer import FragmentState, all_finite, merge_fragment
from pipelines.syncer.hooks import MergeHooks
from resources.store.artifact_store import ArtifactStore, RejectedArtifact


class MergeInputError(RuntimeError):
    """The round cannot be merged at all (no decision, no global version): nothing committed."""


@dataclass(frozen=True)
class MergeOutcome:
    round: int
    fragment: int
    committed: bool              # a new version was committed by this run or an earlier try
    version: int                 # the fragment's version after the round
    record: StoredMerge          # the merge record (members, weights, rejections, norms, ...)
    decision: RoundDecision      # the quorum decision it executed
    finite: bool
    already_committed: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class MergePlan:
    """What every merge of an experiment needs and never changes: built once by a long-lived
    syncer (a merge run builds it per round)."""

    cfg: ExperimentConfig
    plan: FragmentPlan
    tx: optax.GradientTransformation
    templates: tuple      # the outer-state structure of each fragment (for loading it)
    shapes: dict          # parameter name -> shape

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> "MergePlan":
        shapes = {k: v.shape for k, v in abstract_params(cfg.model).items()}
        plan = plan_fragments(shapes, cfg.sync.num_fragments)
        tx = outer_optimizer_for(cfg)
        templates = tuple(tx.init({n: jnp.zeros(shapes[n], jnp.float32) for n in names})
                          for names in plan.fragments)
        return cls(cfg, plan, tx, templates, shapes)


def _merge_of_a_decided_round(store: ArtifactStore, round_index, fragment: int) -> bool:
    if not isinstance(round_index, int) or isinstance(round_index, bool) or round_index < 0:
        return False
    try:
        decision = store.get_decision(round_index)
    except RejectedArtifact:
        return False
    return decision is not None and decision.fragment == fragment


def merge_from_store(store: ArtifactStore, round_index: int,
                     hooks: MergeHooks | None = None,
                     merge_plan: MergePlan | None = None,
                     guard: Callable[[], None] | None = None,
                     merged_by: str = "run",
                     decision: RoundDecision | None = None) -> MergeOutcome:
    """`guard` runs before every write that commits (the syncer's lease check);
    `merged_by` ("syncer" or "run") goes into the version's metadata. `decision`: the round's
    decision as the caller wrote or read it from the store (read here when not given: a merge
    run has only the round's number)."""
    started = time.monotonic()
    guard = guard or (lambda: None)
    hooks = MergeHooks() if hooks is None else hooks     # a chaos run's: its merge faults
    store = hooks.wrap_store(store)
    if merge_plan is None:
        merge_plan = MergePlan.of(config_from_mapping(store.get_config()))
    cfg, plan, tx = merge_plan.cfg, merge_plan.plan, merge_plan.tx
    if decision is None:
        decision = store.get_decision(round_index)
    elif decision.round != round_index:
        raise MergeInputError(f"round {round_index} was given round {decision.round}'s decision")
    if decision is None:
        raise MergeInputError(f"round {round_index} has no quorum decision in the store")
    fragment = decision.fragment
    names = plan.fragments[fragment]
    template = merge_plan.templates[fragment]
    try:
        current = store.load_global(fragment, outer_template=template)
    except KeyError as err:
        raise MergeInputError(f"fragment {fragment} has no committed version: {err}") from None
    done = store.find_round_commit(fragment, round_index, current.version, current.meta)
    if done is not None:
        version, meta = done
        return MergeOutcome(round_index, fragment, True, version, meta, decision, True,
                            already_committed=True)
    pending = store.version_meta(fragment, current.version + 1)
    if pending is not None:
        pending_round = pending.round
        guard()
        if pending_round == round_index:
            # An earlier attempt wrote this round's version but its pointer move was lost.
            store.adopt_version(fragment, current.version + 1)
            return MergeOutcome(round_index, fragment, True, current.version + 1, pending,
                                decision, True, already_committed=True)
        if _merge_of_a_decided_round(store, pending_round, fragment):
            # Another merger (the syncer and a fallback merge run during a hand-over, or a
            # second run of a partition) wrote a decided round's version and has not moved the
            # pointer yet. Never delete another merger's commit: it would then move the
            # pointer to a deleted version, or to this merge's content and report success.
            # Adopt it. An earlier round's version is the next in round order: merge this
            # round on top; a later round's means this round is skipped below.
            store.adopt_version(fragment, current.version + 1)
            current = store.load_global(fragment, outer_template=template)
        else:
            # Not the merge of a decided round of this fragment (a broken or foreign write).
            store.discard_unreferenced(fragment, current.version + 1)
    committed_round = current.meta.round
    if committed_round is not None and committed_round > round_index:
        # A later round of this fragment already merged (this round's first attempt failed):
        # merging these older contributions on top now would apply stale progress twice over.
        meta = StoredMerge(round=round_index, reason=(
            f"{decision.reason}; NOT merged: round {committed_round} of this fragment was "
            "merged first"))
        # Recorded like any round that committed nothing: the ledger and the run's checks
        # find why, instead of a decided round that never appears.
        guard()
        store.put_round_not_merged(round_index, meta)
        return MergeOutcome(round_index, fragment, False, current.version, meta, decision, True)

    # Offers refused when they arrived (replays, copies) keep their reasons in the record.
    contributions, refused = [], dict(decision.refused)
    digests = decision.digests

    def load(learner: str) -> Contribution | str:
        """The member's verified contribution, or why it is refused."""
        try:
            return store.load_contribution(round_index, learner, digest=digests.get(learner))
        except RejectedArtifact as err:
            return f"refused by the store: {err.reason}"
        except KeyError:
            return "admitted but no committed contribution was found"
        except Exception as err:  # noqa: BLE001 - a learner's bytes must not sink the round
            # Whatever a learner wrote is untrusted: anything unforeseen in reading it refuses
            # that contribution with the reason; the other members' round goes on.
            return f"unreadable: {type(err).__name__}: {str(err)[:200]}"
    # Read concurrently (M round trips at once, not one after another), merged in the
    # decision's order of members.
    members = decision.members
    for learner, loaded in zip(members, store.each(load, members), strict=True):
        if isinstance(loaded, str):
            refused[learner] = loaded
        else:
            contributions.append(loaded)

    def base_of(version: int):
        try:
            base = store.load_global(fragment, version)
            return {k: jnp.asarray(v) for k, v in base.params.items()}
        except (KeyError, RejectedArtifact):
            return None

    state = FragmentState({k: jnp.asarray(v) for k, v in current.params.items()},
                          current.version, current.outer_state, base_of)
    new_params, new_outer, record = merge_fragment(
        state, names, plan.num_fragments, round_index, fragment, contributions, cfg.sync, tx,
        is_embedding, decision.reason, decision.late,
        reference_norm=previous_norm_per_step(current.meta),
        average=decision.final and cfg.outer.final_rounds == "average",
        step_tokens=dict(zip(cfg.learners.learner_names, cfg.learner_step_tokens, strict=True)))
    record = dataclasses.replace(record, rejected={**refused, **record.rejected})
    finite = new_params is None or all_finite(new_params)
    meta = StoredMerge.from_json({**_jsonable(dataclasses.asdict(record)), "round": round_index,
                                  "merged_by": merged_by, "finite": bool(finite)})
    committed = False
    version = current.version
    if new_params is not None and finite:
        meta = dataclasses.replace(meta, merge_seconds=time.monotonic() - started,
                                   published_at=time.time())
        hooks.at("before_commit")   # merged in memory, nothing written
        guard()
        store.commit_global(fragment, current.version + 1,
                            {k: np.asarray(v) for k, v in new_params.items()}, new_outer, meta,
                            move_pointer=False)
        hooks.at("during_commit")   # version written, pointer not yet moved
        guard()
        store.adopt_version(fragment, current.version + 1)
        committed, version = True, current.version + 1
        hooks.at("after_commit")
    elif new_params is not None:
        meta = dataclasses.replace(
            meta, reason=f"{meta.reason}; NOT committed: merged parameters are not finite")
    if not committed:
        guard()
        store.put_round_not_merged(round_index, meta)
    return MergeOutcome(round_index, fragment, committed, version, meta, decision, finite,
                        seconds=time.monotonic() - started)


def record_unmergeable(store: ArtifactStore, round_index: int, error: BaseException,
                       guard: Callable[[], None] | None = None) -> StoredMerge:
    """Record that a decided round cannot be merged at all (its merge raised where every
    contribution's own problem is already caught: a bug, or input nothing foresaw), so the
    syncer moves on instead of crash-looping on the same round, and the token ledger finds
    the reason. Its members lose this round's contribution; nothing is committed."""
    try:
        decision = store.get_decision(round_index)
    except RejectedArtifact:
        decision = None
    why = f"merge failed: {type(error).__name__}: {str(error)[:300]}"
    meta = StoredMerge(
        round=round_index, fragment=None if decision is None else decision.fragment,
        rejected={m: why for m in (() if decision is None else decision.members)},
        reason=f"{'decided' if decision is None else decision.reason}; NOT merged: {why}")
    (guard or (lambda: None))()
    store.put_round_not_merged(round_index, meta)
    return meta


def previous_norm_per_step(meta: StoredMerge) -> float | None:
    """The median outer-gradient norm per inner step of the merge that made `meta`'s version
    (the screening reference for rounds with fewer than three contributions)."""
    per_step = sorted(n / max(s, 1) for n, s in zip(meta.outer_grad_norms, meta.steps,
                                                     strict=False) if n > 0)
    return per_step[len(per_step) // 2] if per_step else None


def _jsonable(value):
    """Plain JSON values; a number that is not finite (the norms of a merge that came out NaN)
    becomes None."""
    if isinstance(value, float | np.floating) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
