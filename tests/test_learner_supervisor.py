"""The learner supervisor: one run per learner, relaunch with backoff, none after stop."""

import dagster as dg
import pytest
from orchestration_harness import Harness

from pipelines.defs.supervise_tick import _relaunch_blocked, supervise_tick

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    ["orchestration.restart_backoff_seconds=10"])
        h.start()
        yield h


def _tick(h: Harness, now: float, cursor=None):
    context = dg.build_sensor_context(instance=h.instance, cursor=cursor,
                                      resources={"store": h.resource})
    return supervise_tick(context, h.resource, now=now)


def _learner_run(h: Harness, learner: str, status: dg.DagsterRunStatus):
    return h.instance.create_run_for_job(
        job_def=h.defs.resolve_job_def("learner"),
        run_config={"ops": {"run_learner": {"config": {"learner": learner}}}},
        tags={"diloco/experiment": h.store.experiment, "diloco/learner": learner},
        status=status)


def test_every_learner_gets_one_run_and_running_ones_are_left_alone(harness):
    h = harness
    result = _tick(h, h.now)
    keys = sorted(r.run_key for r in result.run_requests)
    assert keys == [f"learner:exp-test:learner-{i}:0" for i in range(3)]
    config = result.run_requests[0].run_config["ops"]["run_learner"]["config"]
    assert config["attempt"] == 0 and config["learner"].startswith("learner-")
    assert {r.tags["diloco/region"] for r in result.run_requests} == {"local"}
    _learner_run(h, "learner-0", dg.DagsterRunStatus.STARTED)
    _learner_run(h, "learner-1", dg.DagsterRunStatus.STARTING)
    result = _tick(h, h.now)
    assert [r.tags["diloco/learner"] for r in result.run_requests] == ["learner-2"]


def test_a_failed_learner_is_relaunched_after_an_exponential_backoff(harness):
    h = harness
    run = _learner_run(h, "learner-0", dg.DagsterRunStatus.NOT_STARTED)
    h.instance.report_run_failed(run)
    ended = h.instance.get_run_record_by_id(run.run_id).end_time or h.now
    soon = _tick(h, ended + 1)
    assert "learner-0" not in [r.tags["diloco/learner"] for r in soon.run_requests]
    later = _tick(h, ended + 11)
    (relaunch,) = [r for r in later.run_requests if r.tags["diloco/learner"] == "learner-0"]
    assert relaunch.run_key == "learner:exp-test:learner-0:1"
    assert relaunch.run_config["ops"]["run_learner"]["config"]["attempt"] == 1
    # A second consecutive failure doubles the wait.
    second = _learner_run(h, "learner-0", dg.DagsterRunStatus.NOT_STARTED)
    h.instance.report_run_failed(second)
    ended = h.instance.get_run_record_by_id(second.run_id).end_time
    assert "learner-0" not in [r.tags["diloco/learner"] for r in _tick(h, ended + 15).run_requests]
    assert "learner-0" in [r.tags["diloco/learner"] for r in _tick(h, ended + 21).run_requests]


def test_no_relaunch_after_stop_or_for_a_finished_learner(harness):
    h = harness
    h.beat("learner-0", 1, status="done")
    assert "learner-0" not in [r.tags["diloco/learner"] for r in _tick(h, h.now).run_requests]
    h.store.request_stop({"reason": "test"})
    result = _tick(h, h.now)
    assert not result.run_requests


def test_checkpoints_are_recorded_once_per_new_step(harness):
    h = harness
    h.store.put_heartbeat("learner-1", {"status": "training", "time": h.now,
                                        "checkpoint_step": 40, "attempt": 0})
    first = _tick(h, h.now)
    (event,) = first.asset_events
    assert event.partition == "exp-test/learner-1" and event.metadata["step"].value == 40
    again = _tick(h, h.now, cursor=first.cursor)
    assert not again.asset_events



def test_the_restart_budget_is_per_time_window(tmp_path):
    """max_restarts launches per restart_window_seconds: a crash loop is held to that rate,
    and launches that have left the window (a week of preemptions) no longer count."""
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), [
            "orchestration.restart_backoff_seconds=1", "orchestration.max_restarts=2",
            "orchestration.restart_window_seconds=600"])
        h.start()
        for _ in range(3):                                  # three launches, all failed
            h.instance.report_run_failed(_learner_run(h, "learner-0",
                                                      dg.DagsterRunStatus.NOT_STARTED))
        records = h.instance.get_run_records(
            filters=dg.RunsFilter(tags={"diloco/learner": "learner-0"}))
        oldest = min(r.create_timestamp.timestamp() for r in records)
        result = _tick(h, oldest + 100)
        assert "learner-0" not in [r.tags["diloco/learner"] for r in result.run_requests]
        why = _relaunch_blocked(sorted(records, key=lambda r: -r.storage_id),
                                h.cfg.orchestration, oldest + 100)
        assert why.startswith("3 launches in the last 600s (max_restarts 2)"), why
        later = _tick(h, oldest + 601)                      # the oldest left the window
        (relaunch,) = [r for r in later.run_requests if r.tags["diloco/learner"] == "learner-0"]
        assert relaunch.run_config["ops"]["run_learner"]["config"]["attempt"] == 3


def _ran_and_failed(h: Harness, job: str, run_config: dict, tags: dict, started: float,
                    ended: float) -> None:
    """A run of `job` that started at `started` and failed at `ended` (Dagster's own run
    events, stamped with those times, as the run worker and the monitor write them)."""
    from dagster._core.events import DagsterEvent, DagsterEventType

    run = h.instance.create_run_for_job(job_def=h.defs.resolve_job_def(job),
                                        run_config=run_config, tags=tags,
                                        status=dg.DagsterRunStatus.NOT_STARTED)
    for kind, at in ((DagsterEventType.PIPELINE_START, started),
                     (DagsterEventType.PIPELINE_FAILURE, ended)):
        h.instance.report_dagster_event(
            DagsterEvent(event_type_value=kind.value, job_name=job), run_id=run.run_id,
            timestamp=at)


def _syncer_failed(h: Harness, started: float, ended: float) -> None:
    _ran_and_failed(h, "syncer", {"ops": {"run_syncer": {"config": {"attempt": 0}}}},
                    {"diloco/experiment": h.store.experiment, "diloco/syncer": "1"},
                    started, ended)


def _syncer_relaunched(h: Harness, now: float) -> bool:
    return any(r.job_name == "syncer" for r in _tick(h, now).run_requests)


def test_a_syncer_killed_after_a_healthy_spell_is_relaunched_after_the_first_backoff(tmp_path):
    """The backoff doubles over a crash loop, not over a run's whole history: after two quick
    failures (10 s, then 20 s of backoff), a syncer that then worked for ten minutes and was
    killed is relaunched after the first step (10 s), not 40 s; a quick failure after that
    doubles again."""
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), [
            "orchestration.syncer=service", "orchestration.restart_backoff_seconds=10",
            "orchestration.restart_backoff_max_seconds=60"])
        h.start()
        t = h.now
        _syncer_failed(h, t, t + 1)                        # crashed at start-up, twice
        _syncer_failed(h, t + 15, t + 16)
        _syncer_failed(h, t + 40, t + 640)                 # then up for ten minutes, killed
        assert not _syncer_relaunched(h, t + 645)
        assert _syncer_relaunched(h, t + 651)
        _syncer_failed(h, t + 655, t + 656)                # a quick failure after it: doubles
        assert not _syncer_relaunched(h, t + 670)
        assert _syncer_relaunched(h, t + 677)


def test_a_learner_killed_after_a_healthy_spell_is_relaunched_after_the_first_backoff(harness):
    h = harness                                            # restart_backoff_seconds=10
    t = h.now
    tags = {"diloco/experiment": h.store.experiment, "diloco/learner": "learner-0"}
    config = {"ops": {"run_learner": {"config": {"learner": "learner-0"}}}}
    for started, ended in ((t, t + 1), (t + 15, t + 16), (t + 40, t + 640)):
        _ran_and_failed(h, "learner", config, tags, started, ended)
    relaunched = [r.tags["diloco/learner"] for r in _tick(h, t + 651).run_requests]
    assert "learner-0" in relaunched
