"""The quorum sensor's state machine, driven in-process over several rounds.

Scripted learners write heartbeats and contributions to a local store; each `tick` is one
sensor evaluation followed by what the daemon would do (partitions, asset events, run-key
dedup, runs executed in-process), so merges really run and commit to the store.
"""

import dagster as dg
import pytest
from orchestration_harness import JUMPS, Harness

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"))
        h.start()
        yield h


@pytest.fixture
def jumping(tmp_path):
    """A harness whose scripted learners may jump past the budget (`JUMPS`)."""
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), JUMPS)
        h.start()
        yield h


def _progress(h: Harness, learners, steps=2):
    for name in learners:
        h.beat(name, steps)


def _update_events(h: Harness) -> dict[str, dict]:
    records = h.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("learner_update")), limit=100).records
    return {r.partition_key: {k: v.value for k, v in r.asset_materialization.metadata.items()}
            for r in records}


def test_three_rounds_with_k_of_m_and_one_learner_absent(harness):
    h = harness
    assert isinstance(h.tick(), dg.SensorResult)                 # nobody live: no round yet
    assert h.state()["round"] == -1
    present = ["learner-0", "learner-1"]                          # learner-2 never starts
    for r in range(3):
        _progress(h, present)
        h.tick()
        assert h.state()["round"] == r and not h.state()["decided"]
        for name in present:
            h.offer(name, r)
        h.tick()
        assert h.state()["decided"]
    assert h.merged_rounds() == {h.key(r) for r in range(3)}
    for r in range(3):
        meta = h.merge_metadata(r)
        assert meta["members"].value == "learner-0, learner-1"
        assert meta["merged"].value is True
        assert meta["fragment"].value == r % 2
        # One plottable series per learner: weights (0 when absent), reported loss, staleness.
        assert meta["weight/learner-0"].value > 0 and meta["weight/learner-2"].value == 0.0
        assert meta["train_loss/learner-1"].value == 3.0 and "train_loss/learner-2" not in meta
        assert meta["staleness/learner-0"].value == 0
    # Fragment 0 merged in rounds 0 and 2, fragment 1 in round 1.
    assert h.store.current_version(0) == 2 and h.store.current_version(1) == 1
    events = _update_events(h)
    assert {k for k in events} == {f"{h.learner_key(f'learner-{i}')}|{h.key(r)}"
                                   for r in range(3) for i in (0, 1)}
    assert all(e["late"] is False and e["train/loss"] == 3.0 for e in events.values())
    assert all(e["staleness"] == 0 and e["encoding"] == "bf16" for e in events.values())
    # Lineage: the eval ran after every merge.
    assert set(h.instance.get_materialized_partitions(dg.AssetKey("heldout_eval"))) == \
        h.merged_rounds()


def test_repeated_ticks_and_a_lost_cursor_never_merge_a_round_twice(harness):
    h = harness
    _progress(h, ["learner-0", "learner-1"])
    h.tick()
    h.offer("learner-0", 0)
    h.offer("learner-1", 0)
    first = h.tick()
    assert [r.run_key for r in first.run_requests] == ["merge:exp-test:0"]
    for _ in range(3):                                           # nothing new: nothing to do
        again = h.tick()
        assert not again.run_requests and not again.asset_events
    h.cursor = None                                              # the cursor is lost
    recovered = h.tick()
    assert not recovered.run_requests and not recovered.asset_events   # nothing re-reported
    assert h.state()["round"] == 0 and h.state()["decided"]
    runs = h.instance.get_runs(filters=dg.RunsFilter(job_name="merge_round"))
    assert len(runs) == 1
    assert h.store.current_version(0) == 1


def test_a_late_contribution_is_recorded_but_not_merged_into_its_closed_round(harness):
    h = harness
    everyone = ["learner-0", "learner-1", "learner-2"]
    _progress(h, everyone)
    h.tick()
    h.offer("learner-0", 0)
    h.offer("learner-1", 0)
    h.tick()                                   # K=2 reached, no grace (gamma=0): merge now
    decision = h.store.get_decision(0)
    assert list(decision.members) == ["learner-0", "learner-1"]
    assert list(decision.missing) == ["learner-2"]
    assert "grace window" in decision.reason
    h.offer("learner-2", 0)                    # arrives after the round closed
    h.tick()
    events = _update_events(h)
    assert events[f"{h.learner_key('learner-2')}|{h.key(0)}"]["late"] is True
    assert h.merge_metadata(0)["members"].value == "learner-0, learner-1"
    # The next round merges only offers made to it; learner-2's round-0 delta is not reused.
    _progress(h, everyone)
    h.tick()
    assert h.state()["round"] == 1
    for name in everyone:
        h.offer(name, 1)
    h.tick()
    meta = h.merge_metadata(1)
    assert meta["members"].value == "learner-0, learner-1, learner-2"
    assert list(h.store.load_global(0).meta.members) == ["learner-0", "learner-1"]


def test_quorum_unreachable_while_learners_are_down_then_resumes(harness):
    h = harness
    _progress(h, ["learner-0", "learner-1"])
    h.tick()
    h.offer("learner-0", 0)
    h.now += 120                                   # heartbeats go stale: nobody is live
    assert not h.tick().run_requests               # records learner-0's offer, cannot merge
    result = h.tick()
    assert not result.run_requests and not h.state()["decided"]
    assert "quorum unreachable" in result.skip_reason.skip_message
    _progress(h, ["learner-1"], 0)                 # learner-1 is back
    h.offer("learner-1", 0)
    h.tick()
    assert h.merged_rounds() == {h.key(0)}


def _merge_round_0_then_pass_the_budget(h: Harness) -> None:
    """Round 0 merged from learner-0 and learner-1, then both jump past the token budget:
    STOP, and the first final round (one per fragment, P=2) opens."""
    _progress(h, ["learner-0", "learner-1"])
    h.tick()
    h.offer("learner-0", 0)
    h.offer("learner-1", 0)
    h.tick()
    h.beat("learner-0", 400)
    h.beat("learner-1", 400)
    h.tick()


def test_budget_reached_runs_final_rounds_then_the_summary(jumping):
    h = jumping
    _merge_round_0_then_pass_the_budget(h)
    assert h.store.stop_requested() is not None
    for r in (1, 2):
        assert h.state()["round"] == r and h.state()["final"]
        for name in ("learner-0", "learner-1"):
            h.offer(name, r)
        h.tick()
        if r == 1:
            h.cursor = None              # lost mid-finale: one final round is still to come
            h.tick()
            assert h.state()["final_left"] == 1 and h.state()["round"] == 2
    h.tick()
    summary = h.store.get_summary()
    assert summary is not None and summary.outcome.rounds_merged == 3
    assert summary.outcome.final_eval_loss != summary.outcome.initial_eval_loss
    assert [r.admitted for r in summary.rounds] == [("learner-0", "learner-1")] * 3
    assert h.resource.active() is None            # the sensors go quiet


def test_a_final_round_does_not_wait_for_a_learner_with_nothing_to_offer(jumping):
    # learner-1 stopped training right after receiving fragment 1: it answers that final round
    # with nothing to offer (named in its heartbeat), so the round is decided at once instead
    # of after orchestration.round_timeout_seconds.
    h = jumping
    _merge_round_0_then_pass_the_budget(h)
    assert h.state()["round"] == 1 and h.state()["final"]
    h.offer("learner-0", 1)
    h.tick()
    assert not h.state()["decided"]                   # waiting for learner-1
    beat = h.store.get_heartbeat("learner-1")
    h.store.put_heartbeat("learner-1", {**beat.to_json(), "time": h.now, "declined_rounds": [1]})
    h.tick()
    decision = h.store.get_decision(1)
    assert decision is not None and list(decision.members) == ["learner-0"]
    assert list(decision.missing) == [] and "learner-1: nothing new" in decision.reason
    assert h.now - decision.opened_at < h.cfg.orchestration.round_timeout_seconds


def test_a_cursor_behind_the_store_recovers_and_requests_the_missing_merge(harness):
    h = harness
    _progress(h, ["learner-0", "learner-1"])
    h.tick()
    h.offer("learner-0", 0)
    h.offer("learner-1", 0)
    stale = h.cursor                       # the cursor before the deciding tick
    # The deciding tick wrote its decision, then failed before returning: no merge requested,
    # cursor not saved. (Written here by hand: exactly what that tick committed.)
    from pipelines.syncer.round_control import RoundController
    RoundController(h.store).tick(h.state(), now=h.now + 1)
    assert h.store.get_decision(0) is not None and h.merged_rounds() == set()
    h.cursor = stale
    result = h.tick()                      # must not raise on the write-once decision
    assert [r.run_key for r in result.run_requests] == ["merge:exp-test:0"]
    assert h.merged_rounds() == {h.key(0)}
    assert h.state()["decided"] and not h.tick().run_requests


def test_an_offer_is_described_once_even_when_another_decider_wrote_first(jumping):
    """A tick that loses a write to another decider (the syncer and the fallback during a
    hand-over) rebuilds its state from the store; the offers it had already described to
    Dagster are not described again on the next tick."""
    from pipelines.syncer.round_control import RoundController

    h = jumping
    controller = RoundController(h.store)
    _progress(h, ["learner-0", "learner-1"])
    state = controller.tick(None, now=h.now + 1).state          # opens round 0
    h.offer("learner-0", 0)
    first = controller.tick(state, now=h.now + 2)
    assert [(o.round, o.learner) for o in first.offers] == [(0, "learner-0")]
    h.beat("learner-0", 400)                                     # past the budget ...
    h.beat("learner-1", 400)
    h.store.request_stop({"reason": "the other decider", "at": h.now, "tokens": 0,
                          "final_left": 2})                      # ... but STOP is written
    lost = controller.tick(first.state, now=h.now + 3)
    assert "another decider wrote first" in lost.reason, lost.reason
    again = controller.tick(lost.state, now=h.now + 4)
    assert [o.learner for o in again.offers] == [], again.offers


def test_a_round_opened_by_a_tick_that_failed_still_gets_its_partition(harness):
    """A tick that wrote a round-open record and failed before returning added no partition:
    the next tick adds it, and the round's merge run finds its partition."""
    h = harness
    _progress(h, ["learner-0", "learner-1"])
    stale = h.cursor
    from pipelines.syncer.round_control import RoundController
    opened = RoundController(h.store).tick(None, now=h.now + 1).opened   # the failed tick
    assert opened == [0] and h.instance.get_dynamic_partitions("rounds") == []
    h.cursor = stale
    h.tick()
    assert h.instance.get_dynamic_partitions("rounds") == [h.key(0)]
    h.offer("learner-0", 0)
    h.offer("learner-1", 0)
    result = h.tick()
    assert [r.partition_key for r in result.run_requests] == [h.key(0)]
    assert h.merged_rounds() == {h.key(0)}


def test_a_malformed_offer_is_recorded_and_does_not_stop_the_sensor(harness):
    h = harness
    _progress(h, ["learner-0", "learner-1"])
    h.tick()
    h.offer("learner-0", 0)
    key = "experiments/exp-test/rounds/r00000000/contributions/learner-1/manifest.json"
    h.store.blobs.write(key, b'{"format": 1, "kind": "contribution", "extra": [1, 2]}')
    for _ in range(2):
        h.tick()                           # no exception, on this tick or the next
    decision = h.store.get_decision(0)
    assert list(decision.members) == ["learner-0", "learner-1"]
    reasons = h.store.load_global(0).meta.rejected
    assert list(reasons) == ["learner-1"] and "refused by the store" in reasons["learner-1"]


def test_offers_from_unknown_or_unsafe_names_are_ignored_not_merged(harness):
    h = harness
    _progress(h, ["learner-0", "learner-1"])
    h.tick()
    h.offer("learner-0", 0)
    # A stray learner of another experiment, and directory names that are not valid learner
    # names at all (they could never have been written through the store's API).
    h.store.put_contribution(h.contribution("learner-9", 0))
    base = "experiments/exp-test/rounds/r00000000/contributions"
    for name in ("Evil", "..%2f..", "a b"):
        h.store.blobs.write(f"{base}/{name}/manifest.json", b'{"format": 1}')
    for _ in range(3):
        h.tick()                           # the sensor neither crashes nor counts them
    assert h.store.get_decision(0) is None  # quorum K=2 not reached by learner-0 alone
    h.offer("learner-1", 0)
    h.tick()
    h.tick()
    decision = h.store.get_decision(0)
    assert list(decision.members) == ["learner-0", "learner-1"]
    assert "learner-9" not in decision.late
    assert h.merged_rounds() == {h.key(0)}


@pytest.mark.parametrize("final_rounds", ["average", "outer_step"])
def test_a_final_round_publishes_the_members_weighted_average_not_an_outer_step(tmp_path,
                                                                               final_rounds):
    """outer.final_rounds = average (the default) on the orchestrated path: the final merge
    publishes the admitted learners' weighted average fragment (the anchor minus the weighted
    mean outer gradient), with no outer-optimizer step on top; `outer_step` (the old behaviour)
    scales it by the outer lr and adds momentum, so it lands elsewhere."""
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    [f"outer.final_rounds={final_rounds}", *JUMPS])
        h.start()
        _final_round_lands_on_the_average(h, final_rounds == "average")


def _final_round_lands_on_the_average(h: Harness, average: bool) -> None:
    import numpy as np

    _merge_round_0_then_pass_the_budget(h)
    assert h.state()["round"] == 1 and h.state()["final"]
    fragment = 1 % h.cfg.sync.num_fragments
    before = h.store.load_global(fragment)
    h.offer("learner-0", 1, value=0.02, steps=4)
    h.offer("learner-1", 1, value=0.06, steps=12)
    h.tick()
    after = h.store.load_global(fragment)
    assert after.version == before.version + 1
    meta = h.merge_metadata(1)
    w0, w1 = meta["weight/learner-0"].value, meta["weight/learner-1"].value
    assert w0 > 0 and w1 > w0                       # weighted by the tokens they bring
    mean_delta = (0.02 * w0 + 0.06 * w1) / (w0 + w1)
    gaps = [np.abs(values - (before.params[name] - mean_delta)).max()
            for name, values in after.params.items()]
    assert bool(max(gaps) < 1e-3) is average, max(gaps)
