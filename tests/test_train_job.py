"""Starting a run: the `train` job's defaults run as they are, bad configs fail before compute,
and the orchestrated defaults layer under a config file and overrides."""

import dagster as dg
import pytest

from diloco_core.config import ConfigError
from pipelines.commands.config_layers import load_config
from pipelines.definitions import defs as load_defs
from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
from resources.store.resource import ArtifactStoreResource


def _defs(store_uri: str) -> dg.Definitions:
    loaded = load_defs()
    return dg.Definitions(
        assets=loaded.assets, asset_checks=loaded.asset_checks, jobs=loaded.jobs,
        resources={**loaded.resources, "store": ArtifactStoreResource(base_uri=store_uri)})


def test_the_launchpad_defaults_start_an_orchestrated_experiment(tmp_path):
    store = ArtifactStoreResource(base_uri=str(tmp_path / "store"))
    with dg.instance_for_test() as instance:
        result = _defs(store.base_uri).resolve_job_def("train").execute_in_process(
            instance=instance)        # no run config at all: the form's defaults
        assert result.success
        active = store.active()
        assert active is not None and active.experiment == "diloco-demo"
        cfg = active.get_config()
        assert cfg["learners"]["num_learners"] == 4 and cfg["sync"]["sync_period"] == 16
        assert instance.get_dynamic_partitions("learners") == [
            f"diloco-demo/learner-{i}" for i in range(4)]
        assert all(active.current_version(p) == 0 for p in range(4))


def test_a_bad_config_is_refused_at_launch_naming_the_field_and_no_run_exists(tmp_path):
    # K > M passes Dagster's schema (each field is well typed); the sections' own check across
    # fields refuses it when the run is launched, before Dagster creates the run.
    bad = {"ops": {"start_experiment": {"config": {"overrides": ["sync.min_quorum=9"]}}}}
    job = _defs(str(tmp_path / "store")).resolve_job_def("train")
    with dg.instance_for_test() as instance:
        with pytest.raises(dg.DagsterInvalidConfigError,
                           match=r"sync\.min_quorum: must be <= learners\.num_learners"):
            instance.create_run_for_job(job, run_config=bad)
        with pytest.raises(dg.DagsterInvalidConfigError, match=r"sync\.min_quorum"):
            job.execute_in_process(instance=instance, run_config=bad)
        assert instance.get_runs() == []
    assert not (tmp_path / "store" / "experiments").exists()     # nothing was written


def test_defaults_layer_under_the_file_and_the_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("token_budget: 5000\nsync:\n  min_quorum: 3\n")
    cfg = load_config(str(path), ["sync.min_quorum=1"], base=ORCHESTRATED_DEFAULTS)
    assert cfg.token_budget == 5000                     # the file beats the defaults
    assert cfg.sync.min_quorum == 1                     # --set beats the file
    assert cfg.sync.sync_period == 16                   # untouched defaults stay
    # A per-learner list the user gives must still match the number of learners.
    with pytest.raises(ConfigError, match="learners.speeds"):
        load_config(None, ["learners.num_learners=3", "learners.speeds=[1.0, 0.5]"],
                    base=ORCHESTRATED_DEFAULTS)


def test_a_second_experiment_does_not_orphan_the_active_one_and_a_relaunch_resumes(tmp_path):
    store = ArtifactStoreResource(base_uri=str(tmp_path / "store"))
    defs = _defs(store.base_uri)

    def train(name: str, **extra):
        return defs.resolve_job_def("train").execute_in_process(
            instance=instance, raise_on_error=False,
            run_config={"ops": {"start_experiment": {"config": {
                "overrides": [f"name={name}", "model.preset=tiny"], **extra}}}})

    with dg.instance_for_test() as instance:
        assert train("first").success
        refused = train("second")
        assert not refused.success
        failure = next(e for e in refused.all_events if e.is_step_failure)
        message = str(failure.step_failure_data.user_failure_data.description)
        assert "'first' is still active" in message and "replace_active" in message
        assert store.active().experiment == "first"
        assert store.store("second").get_config() is None              # nothing written
        # Launching the active experiment again resumes it: same config, versions kept.
        store.store("first").commit_global(0, 1, store.store("first").load_global(0).params,
                                           store.store("first").load_global(0).outer_state,
                                           {"round": 0})
        assert train("first").success
        assert store.active().experiment == "first"
        assert store.store("first").current_version(0) == 1
        # Once finished (or on the operator's word) another may start.
        assert train("second", replace_active=True).success
        assert store.active().experiment == "second"
        store.store("second").mark_finished({"reason": "test"})
        assert train("third").success and store.active().experiment == "third"


def test_a_resume_may_raise_the_token_budget_and_the_run_stops_at_the_new_one(tmp_path):
    from orchestration_harness import JUMPS, Harness

    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), ["token_budget=20000", *JUMPS])
        h.start()

        def relaunch(*overrides):
            return h.defs.resolve_job_def("train").execute_in_process(
                instance=instance, raise_on_error=False,
                run_config={"ops": {"start_experiment": {"config": {
                    "overrides": [*h.overrides, *overrides],
                    "orchestrated_defaults": False}}}})

        def refusal(result) -> str:
            assert not result.success
            failure = next(e for e in result.all_events if e.is_step_failure)
            return str(failure.step_failure_data.user_failure_data.description)

        assert relaunch("token_budget=50000").success
        assert h.store.token_budget(h.cfg.token_budget) == 50000
        assert "can only be raised" in refusal(relaunch("token_budget=30000"))
        assert "a resume may change only token_budget" in refusal(
            relaunch("token_budget=60000", "sync.min_quorum=1"))
        assert h.store.token_budget(h.cfg.token_budget) == 50000       # nothing written
        # Past the configured budget, short of the raised one: the run goes on.
        for name in ("learner-0", "learner-1", "learner-2"):
            h.beat(name, 60)                    # 3 x 60 x 128 = 23,040 tokens
        h.tick()
        assert h.store.stop_requested() is None
        for name in ("learner-0", "learner-1", "learner-2"):
            h.beat(name, 80)                    # 53,760 tokens in all
        h.tick(advance=3.0)
        assert "token budget reached (53760 >= 50000)" in h.store.stop_requested()["reason"]
        assert "already stopped" in refusal(relaunch("token_budget=90000"))
