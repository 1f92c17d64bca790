"""The merge job refuses bad contributions, each with its reason, and still merges the rest."""

import datetime

import dagster as dg
import numpy as np
import pytest
from orchestration_harness import Harness

from pipelines.partition_keys import partition_key
from resources.chaos.hostile_records import CONTRIBUTION_ATTACKS, damage_offer
from resources.store import layout
from resources.store.artifact_store import Conflict

pytestmark = pytest.mark.timeout(300)


def _decide(h: Harness, round_index: int, members: list[str]) -> None:
    """What the quorum sensor commits before requesting a merge."""
    h.store.open_round(round_index, {"fragment": 0, "opened_at": h.now, "final": False})
    h.instance.add_dynamic_partitions("rounds", [h.key(round_index)])
    h.store.put_decision(round_index, {
        "round": round_index, "fragment": 0, "members": members, "late": [], "missing": [],
        "reason": f"test decision for round {round_index}", "quorum_at": h.now,
        "decided_at": h.now})


def _merge(h: Harness, round_index: int) -> dict:
    result = h.defs.resolve_job_def("merge_round").execute_in_process(
        instance=h.instance, partition_key=h.key(round_index),
        tags={"diloco/experiment": h.store.experiment})
    assert result.success
    (mat,) = result.asset_materializations_for_node("global_params")
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    return {"meta": mat.metadata, "checks": checks}


@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    ["sync.num_fragments=1", "learners.num_learners=8", "sync.min_quorum=1"])
        h.start()
        yield h


def test_bad_contributions_are_rejected_with_their_reasons(harness):
    h = harness
    # Two clean rounds, then retention deletes version 1's arrays: it is no longer kept.
    for r in (0, 1):
        for name in ("learner-0", "learner-1"):
            h.offer(name, r, seed=r)
        _decide(h, r, ["learner-0", "learner-1"])
        _merge(h, r)
    assert h.store.current_version(0) == 2
    h.store.prune_version(0, 1, "test")

    r = 2
    h.offer("learner-0", r)
    h.offer("learner-1", r, seed=1)
    h.offer("learner-2", r, value=np.nan)                                     # NaN
    h.offer("learner-3", r, shape_of=lambda name, shape: (shape[0] + 1,) + shape[1:])
    h.offer("learner-4", r, fragment=1)                                        # no such fragment
    h.offer("learner-5", r, base_version=1)                                    # base pruned
    h.offer("learner-6", r, scale=1000.0)                                      # absurd norm
    h.offer("learner-7", r)                                                    # then truncated
    directory = layout.contribution_dir(h.store.experiment, r, "learner-7")
    (payload,) = [k for k in h.store.blobs.list(directory + "/") if k.endswith(".npz")]
    data = h.store.blobs.read(payload)
    h.store.blobs.write(payload, data[: len(data) // 2])
    members = [f"learner-{i}" for i in range(8)]
    _decide(h, r, members)
    out = _merge(h, r)

    meta = out["meta"]
    assert meta["members"].value == "learner-0, learner-1"
    assert meta["version"].value == 3 and meta["merged"].value is True
    assert -1.0 <= meta["mean_pairwise_cosine"].value <= 1.0     # two members: defined
    table = {row.data["learner"]: row.data for row in meta["decisions"].value.records}
    reasons = {name: row["reason"] for name, row in table.items() if row["status"] == "rejected"}
    assert set(reasons) == {f"learner-{i}" for i in range(2, 8)}
    assert "NaN" in reasons["learner-2"]
    assert "has shape" in reasons["learner-3"]
    assert "fragment 1 does not exist" in reasons["learner-4"]
    assert "no longer kept" in reasons["learner-5"]
    assert "median of the others" in reasons["learner-6"]
    assert reasons["learner-7"].startswith("refused by the store")
    assert out["checks"]["params_finite"].passed
    assert not out["checks"]["contribution_norms"].passed      # the absurd one was excluded
    committed = h.store.load_global(0)
    assert committed.version == 3 and committed.meta.rejected.keys() == reasons.keys()
    assert all(np.isfinite(v).all() for v in committed.params.values())


def test_a_retried_merge_run_does_not_merge_twice(harness):
    h = harness
    h.offer("learner-0", 0)
    _decide(h, 0, ["learner-0"])
    first = _merge(h, 0)
    before = h.store.load_global(0)
    again = _merge(h, 0)
    after = h.store.load_global(0)
    assert first["meta"]["version"].value == again["meta"]["version"].value == 1
    assert after.version == 1
    assert all(np.array_equal(before.params[k], after.params[k]) for k in before.params)


def test_a_round_without_a_decision_fails_clearly(harness):
    h = harness
    h.instance.add_dynamic_partitions("rounds", [h.key(5)])
    result = h.defs.resolve_job_def("merge_round").execute_in_process(
        instance=h.instance, partition_key=h.key(5), raise_on_error=False,
        tags={"diloco/experiment": h.store.experiment})
    assert not result.success
    failure = [e for e in result.all_events if e.is_step_failure][0]
    assert "round 5 has no quorum decision" in str(failure.step_failure_data.error.message) \
        or "round 5 has no quorum decision" in str(failure.step_failure_data.user_failure_data)


def test_a_run_works_on_its_partitions_experiment_and_refuses_a_tag_naming_another(harness):
    h = harness
    h.offer("learner-0", 0)
    _decide(h, 0, ["learner-0"])
    mixed = h.defs.resolve_job_def("merge_round").execute_in_process(
        instance=h.instance, partition_key=h.key(0), raise_on_error=False,
        tags={"diloco/experiment": "other-exp"})
    assert not mixed.success
    failure = [e for e in mixed.all_events if e.is_step_failure][0]
    assert "belongs to 'exp-test'" in str(failure.step_failure_data.user_failure_data.description)
    assert h.store.current_version(0) == 0                 # nothing merged
    # Without a tag the partition says which experiment (not "whichever is active").
    untagged = h.defs.resolve_job_def("merge_round").execute_in_process(
        instance=h.instance, partition_key=h.key(0))
    assert untagged.success and h.store.current_version(0) == 1


def test_a_commit_whose_pointer_move_was_lost_is_adopted_not_redone(harness):
    h = harness
    h.offer("learner-0", 0)
    _decide(h, 0, ["learner-0"])
    # A first attempt wrote version 1 for round 0, then died before moving the pointer.
    g = h.store.load_global(0)
    from resources.store import layout as lay
    # The store's own commit, then the pointer put back: as if the move never happened.
    h.store.commit_global(0, 1, g.params, g.outer_state, {"round": 0, "reason": "first"})
    pointer = lay.pointer(h.store.experiment, 0)
    h.store.blobs.write(pointer, b'{"version": 0}')
    assert h.store.current_version(0) == 0
    out = _merge(h, 0)
    assert out["meta"]["version"].value == 1
    assert h.store.current_version(0) == 1
    assert h.store.version_meta(0).reason == "first"       # adopted, not merged again


def test_an_orphan_version_of_another_round_is_replaced_and_a_superseded_round_skipped(harness):
    h = harness
    g = h.store.load_global(0)
    from resources.store import layout as lay
    h.store.commit_global(0, 1, g.params, g.outer_state, {"round": 7})   # orphan of round 7
    h.store.blobs.write(lay.pointer(h.store.experiment, 0), b'{"version": 0}')
    h.offer("learner-0", 0)
    _decide(h, 0, ["learner-0"])
    _merge(h, 0)
    assert h.store.current_version(0) == 1 and h.store.version_meta(0).round == 0
    # Round 2 merges before a retry of round 1: round 1 is then skipped, not applied late.
    h.offer("learner-0", 2, seed=2)
    _decide(h, 2, ["learner-0"])
    _merge(h, 2)
    h.offer("learner-0", 1, seed=1)
    _decide(h, 1, ["learner-0"])
    out = _merge(h, 1)
    assert out["meta"]["merged"].value is False
    assert "round 2 of this fragment was merged first" in out["meta"]["decision_reason"].value
    assert h.store.current_version(0) == 2


def test_two_merges_of_one_fragment_never_delete_each_others_version(harness):
    """Merge A (a later round of fragment 0) has written its version but not yet moved the
    pointer when merge B (an earlier round, e.g. a UI re-materialization) runs: B adopts A's
    version and skips its own older round; A's pointer move then finds its own version
    current. Before, B deleted A's version and A moved the pointer to B's content (or to a
    deleted version), both reporting success."""
    from pipelines.syncer.store_merge import MergePlan, merge_from_store

    h = harness
    h.offer("learner-0", 0)
    _decide(h, 0, ["learner-0"])
    h.offer("learner-0", 1, seed=1)
    _decide(h, 1, ["learner-0"])
    plan = MergePlan.of(h.cfg)
    g = h.store.load_global(0)
    h.store.commit_global(0, 1, g.params, g.outer_state, {"round": 1, "reason": "A"},
                          move_pointer=False)                  # merge A, mid-commit
    outcome = merge_from_store(h.store, 0, merge_plan=plan)   # merge B, an earlier round
    assert not outcome.committed and outcome.record.merged is False
    assert h.store.current_version(0) == 1 and h.store.version_meta(0).reason == "A"
    h.store.adopt_version(0, 1)                                # A's own pointer move: a no-op
    assert h.store.version_meta(0).reason == "A"
    # Nor can a pointer be moved to a version that is not committed.
    with pytest.raises(Conflict, match="not committed"):
        h.store.adopt_version(0, 2)


@pytest.mark.parametrize("attack", sorted(CONTRIBUTION_ATTACKS))
def test_one_hostile_contribution_is_refused_and_the_honest_one_merges(harness, attack):
    """Everything a learner writes is untrusted: a malformed manifest or payload refuses that
    contribution with a reason; the other member's round merges."""
    h = harness
    h.offer("learner-0", 0)
    h.offer("learner-1", 0, seed=1)
    damage_offer(h.store, 0, "learner-1", attack)
    _decide(h, 0, ["learner-0", "learner-1"])
    out = _merge(h, 0)
    assert out["meta"]["merged"].value is True
    assert out["meta"]["members"].value == "learner-0"
    rejected = h.store.version_meta(0).rejected
    assert set(rejected) == {"learner-1"} and rejected["learner-1"]


def test_a_round_whose_every_contribution_is_refused_keeps_the_reasons(harness):
    from pipelines.token_ledger import offer_fates

    h = harness
    h.offer("learner-0", 0, value=np.nan)
    h.offer("learner-1", 0, fragment=1)
    _decide(h, 0, ["learner-0", "learner-1"])
    out = _merge(h, 0)
    assert out["meta"]["merged"].value is False and h.store.current_version(0) == 0
    record = h.store.get_round_not_merged(0)
    assert "NaN" in record.rejected["learner-0"]
    assert "fragment 1 does not exist" in record.rejected["learner-1"]
    _merge(h, 0)                                   # a retry finds the record, writes nothing new
    # The ledger counts their tokens as rejected, with the reason, not "round not merged"; a
    # directory from a name outside the experiment is never read.
    prefix = layout.contributions_prefix(h.store.experiment, 0)
    h.store.blobs.write(f"{prefix}Evil/manifest.json", b"not json")
    _, fates, rejections = offer_fates(h.store, 1, h.cfg.learners.learner_names)
    assert fates == {(0, "learner-0"): "rejected", (0, "learner-1"): "rejected"}
    assert {r["learner"]: r["reason"] for r in rejections} == record.rejected


def test_the_eval_schedule_evaluates_the_active_experiments_newest_merged_round(harness):
    """It used to pick the newest round partition of any experiment and fail every 30
    minutes once a run had finished (no active experiment, no experiment tag)."""
    from pipelines.defs.rounds import eval_latest_round

    h = harness

    def evaluate():
        # Entered with `with`: the context opens an instance from the ref, and left open that
        # instance stays Dagster's current defs-state storage for the rest of the session.
        with dg.build_schedule_context(
                instance=h.instance, resources={"store": h.resource},
                scheduled_execution_time=datetime.datetime(2026, 11, 24, 1, 30,
                                                           tzinfo=datetime.UTC)) as context:
            return eval_latest_round(context)

    assert isinstance(evaluate(), dg.SkipReason)          # nothing merged yet
    for r in range(2):
        h.offer("learner-0", r)
        _decide(h, r, ["learner-0"])
        _merge(h, r)
    # Another experiment's newer round on the same instance: never this experiment's.
    h.instance.add_dynamic_partitions("rounds", [partition_key("other-exp", 7)])
    (request,) = [evaluate()]
    assert request.partition_key == h.key(1)
    assert request.tags["diloco/experiment"] == h.store.experiment
    # Round 1's eval not yet in the store (as when the syncer evaluates every P merges): the
    # schedule's 16-batch eval is Dagster's only; the store keeps one series, on the
    # experiment's eval_batches.
    h.store.blobs.delete(layout.evaluation(h.store.experiment, 1))
    result = h.defs.resolve_job_def("evaluate_round").execute_in_process(
        instance=h.instance, partition_key=request.partition_key, tags=request.tags,
        run_config=request.run_config)
    assert result.success
    (mat,) = result.asset_materializations_for_node("heldout_eval")
    assert mat.metadata["batches"].value == 16
    standard = h.cfg.orchestration.eval_batches
    assert standard != 16
    assert h.store.get_eval(1) is None and h.store.get_eval(0).batches == standard
    h.resource.set_active(None)                           # the run finished
    skip = evaluate()
    assert isinstance(skip, dg.SkipReason) and "no experiment is active" in skip.skip_message


def test_the_eval_regression_check_compares_only_evals_on_the_same_batches():
    from pipelines.round_metadata import eval_regression
    from resources.store.summary_records import HeldoutEval

    def on(loss, batches):
        return HeldoutEval(loss=loss, bits_per_byte=loss / 0.69, batches=batches)

    four = on(2.0, 4)
    assert not eval_regression(on(2.2, 4), four).passed     # +10%
    assert eval_regression(on(2.05, 4), four).passed
    # A 16-batch eval 10% above a 4-batch one measured other text: not a regression.
    other = eval_regression(on(2.2, 16), four)
    assert other.passed and other.metadata["previous_loss"] != 2.0
    assert eval_regression(on(2.2, 4), None).passed


def test_a_merge_that_comes_out_not_finite_is_recorded_not_committed(harness, monkeypatch):
    """Merged parameters that are NaN (and so their norms) are never committed: the round is
    recorded as not merged with why, and `params_finite` fails. Its NaN norms are recorded as
    unknown, since JSON has no NaN (validating them as numbers failed the whole merge)."""
    import dataclasses

    import jax.numpy as jnp

    import pipelines.syncer.store_merge as store_merge

    real_merge = store_merge.merge_fragment

    def merge_to_nan(*args, **kwargs):
        params, outer, record = real_merge(*args, **kwargs)
        nan = {k: jnp.full_like(v, jnp.nan) for k, v in params.items()}
        return nan, outer, dataclasses.replace(record, merged_norm=float("nan"),
                                               update_norm=float("nan"))

    monkeypatch.setattr(store_merge, "merge_fragment", merge_to_nan)
    h = harness
    h.offer("learner-0", 0)
    h.offer("learner-1", 0, seed=1)
    _decide(h, 0, ["learner-0", "learner-1"])
    result = h.defs.resolve_job_def("merge_round").execute_in_process(
        instance=h.instance, partition_key=h.key(0),
        tags={"diloco/experiment": h.store.experiment}, raise_on_error=False)
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert not checks["params_finite"].passed          # blocking: the run fails on it
    assert h.store.current_version(0) == 0                 # nothing committed
    record = h.store.get_round_not_merged(0)
    assert "NOT committed: merged parameters are not finite" in record.reason
    assert record.finite is False and record.merged_norm is None and record.update_norm is None


def test_a_version_whose_merge_record_is_malformed_reads_as_no_round(harness):
    """Only the merge writes a version's record, and it validates first; a foreign or broken
    one must not stop every reader (the ledger, the summary, a learner's poll): it reads as
    the merge of no round, with the refusal as its reason, and the next merge replaces it."""
    import json

    from pipelines.token_ledger import offer_fates

    h = harness
    g = h.store.load_global(0)
    h.store.commit_global(0, 1, g.params, g.outer_state, {"round": 0}, move_pointer=False)
    key = f"{layout.version_dir(h.store.experiment, 0, 1)}/{layout.MANIFEST}"
    manifest = json.loads(h.store.blobs.read(key))
    h.store.blobs.write(key, json.dumps({**manifest, "meta": {"round": "zero"}}).encode())
    meta = h.store.version_meta(0, 1)
    assert meta.round is None and meta.reason.startswith("refused: "), meta
    assert "merge.round: must be an integer" in meta.reason
    offer_fates(h.store, 1, h.cfg.learners.learner_names)          # reads every version
    h.offer("learner-0", 0)
    _decide(h, 0, ["learner-0"])
    _merge(h, 0)                                 # the broken version is discarded, not kept
    assert h.store.current_version(0) == 1 and h.store.version_meta(0).round == 0


def test_a_merge_given_its_decision_merges_it_and_refuses_another_rounds(harness):
    """The syncer passes the decision it just wrote instead of the merge reading it back; a
    decision of another round is refused, never merged as this one."""
    from pipelines.syncer.store_merge import MergeInputError, MergePlan, merge_from_store

    h = harness
    h.offer("learner-0", 0)
    _decide(h, 0, ["learner-0"])
    decision = h.store.get_decision(0)
    plan = MergePlan.of(h.cfg)
    with pytest.raises(MergeInputError, match="round 1 was given round 0's decision"):
        merge_from_store(h.store, 1, merge_plan=plan, decision=decision)
    outcome = merge_from_store(h.store, 0, merge_plan=plan, decision=decision)
    assert outcome.committed and outcome.decision == decision
    assert h.store.version_meta(0).round == 0
