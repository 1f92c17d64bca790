"""Round partitions that stay within Dagster's advised ~100,000 per asset at the paper's cadence:
one partition per round for short runs, whole outer steps per partition for long ones: a merge
run materializes its own round (the sensor path), the syncer service's mirror one digest per
asset and partition (its database then grows by the partition, not the round)."""

import dagster as dg
import pytest
from orchestration_harness import Harness

from diloco_core.config import ROUND_PARTITIONS_MAX
from pipelines.commands.cli import load_config
from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
from pipelines.partition_keys import (
    learner_partition_key,
    partition_experiment,
    partition_key,
    partition_rounds,
)

pytestmark = pytest.mark.timeout(300)

WINDOWS = ["exp-test/00000000-00000001", "exp-test/00000002-00000003"]
PAIR = ["learner-0", "learner-1"]


def test_partition_keys_name_their_experiment_and_rounds():
    assert partition_key("e1", 7) == "e1/00000007"
    assert partition_rounds("e1/00000007") == range(7, 8)
    assert partition_key("e1", 130, 64) == "e1/00000128-00000191"
    assert list(partition_rounds(partition_key("e1", 130, 64))) == list(range(128, 192))
    keys = [partition_key("e1", r, 24) for r in (0, 23, 24, 99_999_999)]
    assert keys == sorted(keys) and keys[0] == keys[1] != keys[2]
    # Two experiments on one instance never share a round's or a learner's partition.
    assert partition_key("e1", 7) != partition_key("e2", 7)
    assert partition_experiment(partition_key("e2", 130, 64)) == "e2"
    assert learner_partition_key("e1", "learner-0") != learner_partition_key("e2", "learner-0")
    assert partition_experiment(learner_partition_key("e2", "learner-0")) == "e2"


def test_automatic_partitions_keep_a_month_at_the_papers_cadence_under_the_limit():
    demo = load_config(None, [], base=ORCHESTRATED_DEFAULTS)
    assert demo.rounds_per_partition == 1               # the demo: a partition per round
    # A month of steps at one second each, a fragment round every step (H = P = 24).
    month = 30 * 24 * 3600
    paper = load_config(None, ["sync.sync_period=24", "sync.num_fragments=24",
                               "sync.overlap_steps=1"])
    paper = paper.replace(token_budget=month * sum(paper.learner_step_tokens))
    assert paper.expected_rounds >= month
    per = paper.rounds_per_partition
    assert per % 24 == 0                                # whole outer steps
    assert paper.expected_rounds / per <= ROUND_PARTITIONS_MAX
    fixed = load_config(None, ["orchestration.rounds_per_partition=5"])
    assert fixed.rounds_per_partition == 5


def _events(h: Harness, asset: str) -> list[tuple[str, int]]:
    records = h.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset)), limit=100).records
    return sorted((r.partition_key, r.asset_materialization.metadata["round"].value)
                  for r in records)


def _play(h: Harness, step, rounds=range(4)) -> None:
    """Four rounds, two learners offering each: `step` is one decider tick."""
    for r in rounds:
        for name in [*PAIR, "learner-2"]:
            h.beat(name, 2)
        step()
        for name in PAIR:
            h.offer(name, r)
        step()


@pytest.mark.parametrize("path", ["sensor", "service"])
def test_two_rounds_per_partition_on_both_paths(tmp_path, path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=[
            f"orchestration.syncer={path}", "orchestration.rounds_per_partition=2"])
        h.start()
        step, _ = h.decider(path)
        _play(h, step)
        if path == "service":
            h.tick()                                    # the sensor mirrors what it did
        for r in range(4):
            assert h.store.version_meta(r % 2, r // 2 + 1).round == r     # merged once
        assert instance.get_dynamic_partitions("rounds") == WINDOWS
        expected = [(WINDOWS[r // 2], r) for r in range(4)]
        updates = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("learner_update")), limit=100).records
        evals = _events(h, "heldout_eval")
        if path == "sensor":
            # Each merge run materializes its own round, and each offer is recorded.
            assert _events(h, "global_params") == expected
            assert sorted(r.partition_key for r in updates) == sorted(
                f"exp-test/{n}|{WINDOWS[r // 2]}" for r in range(4) for n in PAIR)
            assert evals == expected                    # each merge run evaluates its round
        else:
            # The mirror records one digest per asset and partition once its rounds are all
            # mirrored (the database grows by the partition, not the round), named by the
            # partition's last round; every round's figures are in it.
            assert _events(h, "global_params") == [(WINDOWS[0], 1), (WINDOWS[1], 3)]
            digests = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("global_params")),
                limit=100).records
            for record in digests:
                meta = record.asset_materialization.metadata
                assert (meta["rounds"].value, meta["rounds_merged"].value) == (2, 2)
                assert meta["admitted_min"].value == 2
            last = max(digests, key=lambda r: r.partition_key).asset_materialization.metadata
            assert last["versions"].value == {"0": 2, "1": 2}
            assert evals == [(WINDOWS[0], 1), (WINDOWS[1], 3)]   # once per outer step (P = 2)
            # A learner's digest waits until its partition's rounds take no more late offers
            # (LATE_WINDOW rounds after their decision): four rounds more close both windows.
            assert updates == []
        # One params_finite evaluation per merge run (sensor path), or per partition once all
        # its rounds are mirrored (service path: Dagster keeps one runless evaluation per
        # partition, and a second would fail the sensor's every later tick).
        history = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(dg.AssetKey("global_params"), "params_finite"), limit=100)
        if path == "sensor":
            assert len(history) == 4
        else:
            assert sorted(c.partition for c in history) == WINDOWS
        if path == "service":
            h.tick()                                    # nothing new: nothing evaluated again
            assert len(instance.event_log_storage.get_asset_check_execution_history(
                dg.AssetCheckKey(dg.AssetKey("global_params"), "params_finite"),
                limit=100)) == 2
            _play(h, step, range(4, 8))                 # closes rounds 0-3 to late offers
            h.tick()
            updates = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("learner_update")),
                limit=100).records
            assert sorted(r.partition_key for r in updates) == sorted(
                f"exp-test/{n}|{w}" for w in WINDOWS for n in PAIR)
            for record in updates:
                meta = record.asset_materialization.metadata
                assert meta["offers"].value == 2 and meta["tokens"].value > 0
        if path == "sensor":
            # A run on a window without the round tag cannot guess which round: it says so.
            result = h.defs.resolve_job_def("evaluate_round").execute_in_process(
                instance=instance, partition_key=WINDOWS[0], raise_on_error=False)
            assert not result.success
            failure = next(e for e in result.all_events if e.is_step_failure)
            assert "diloco/round" in failure.step_failure_data.user_failure_data.description


def test_a_finished_run_whose_mirror_is_behind_gets_one_digest_per_partition(
        tmp_path, monkeypatch):
    # The mirror takes at most MAX_ROUNDS_PER_TICK rounds a tick (a daemon restart near the
    # end leaves it behind): a partition is released only once all its rounds are mirrored,
    # even when the run has finished meanwhile, never as two digests each with part of it.
    import pipelines.round_mirror as round_mirror
    from resources.store.artifact_store import ArtifactStore

    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=[
            "orchestration.syncer=service", "orchestration.rounds_per_partition=4"])
        h.start()
        step, _ = h.decider("service")
        _play(h, step)                                  # 4 rounds, nothing mirrored yet
        monkeypatch.setattr(round_mirror, "MAX_ROUNDS_PER_TICK", 2)
        monkeypatch.setattr(ArtifactStore, "finished", lambda self: {"reason": "test"})
        for _ in range(3):
            h.tick()
        digests = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("global_params")), limit=10).records
        assert [r.asset_materialization.metadata["rounds"].value for r in digests] == [4]
        # The summary (which ends the mirroring) is requested once the mirror caught up.
        assert [r.job_name for r in h.launched] == ["summarize"]
