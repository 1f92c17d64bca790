"""Scavenged capacity in orchestrated runs: the capacity record, its changes (CLI, job, fault
tape, two operators racing), and what the supervisor and the round controller make of it."""

import json
import subprocess
import sys
import textwrap

import dagster as dg
import pytest
from orchestration_harness import Harness

from diloco_core.capacity import MAX_CHANGES, Capacity, CapacityError
from diloco_core.config import ConfigError
from diloco_core.config_loading import config_from_mapping, overrides_to_mapping
from diloco_core.round_records import RecordError
from pipelines.capacity_control import apply_tape, change_capacity, current_capacity
from pipelines.commands.cli import main
from pipelines.defs.supervise_tick import supervise_tick
from resources.chaos.faults import load_tape

pytestmark = pytest.mark.timeout(300)
ROSTER = ("learner-0", "learner-1", "learner-2")


# ---- the record -----------------------------------------------------------------------------

def test_changes_are_recorded_in_order_and_refused_with_a_reason():
    record = Capacity.at_launch(["learner-2"])
    assert record.present(ROSTER) == ("learner-0", "learner-1")
    record = record.change("learner-2", "join", ROSTER, at=10.0, by="op", reason="spot",
                           round_index=3)
    record = record.change("learner-0", "leave", ROSTER, at=20.0, by="op")
    assert record.absent == ("learner-0",)
    assert [(c.learner, c.action, c.round) for c in record.changes] == [
        ("learner-2", "join", 3), ("learner-0", "leave", None)]
    assert Capacity.from_json(json.loads(json.dumps(record.to_json()))) == record
    for learner, action, why in (("learner-9", "join", "not on the roster"),
                                 ("learner-1", "join", "already present"),
                                 ("learner-0", "leave", "already absent")):
        with pytest.raises(CapacityError, match=why):
            record.change(learner, action, ROSTER, at=30.0)
    with pytest.raises(CapacityError, match="fewer than the 2 needed"):
        record.change("learner-1", "leave", ROSTER, at=30.0, min_present=2)
    last = record.change("learner-1", "leave", ROSTER, at=30.0)
    with pytest.raises(CapacityError, match="would leave 0 present"):
        last.change("learner-2", "leave", ROSTER, at=40.0)


def test_a_malformed_record_is_refused_naming_the_field():
    with pytest.raises(RecordError, match="capacity.absent"):
        Capacity.from_json({"absent": "learner-0"})
    with pytest.raises(RecordError, match=r"changes: \[0\] capacity_change.action"):
        Capacity.from_json({"changes": [{"learner": "a", "action": "explode", "at": 1.0}]})
    with pytest.raises(RecordError, match="more than"):
        Capacity.from_json({"changes": [{"learner": "a", "action": "join", "at": 1.0}]
                            * (MAX_CHANGES + 1)})


def config_from_overrides(overrides):
    return config_from_mapping(overrides_to_mapping(overrides))


def test_standby_is_validated_against_the_roster_and_the_quorum():
    base = ["learners.num_learners=3", "sync.min_quorum=2"]
    assert config_from_overrides([*base, "learners.standby=1"]).learners.standby_names == (
        "learner-2",)
    for value, field_name in (("3", "learners.standby"), ("-1", "learners.standby"),
                              ("2", "learners.standby")):
        with pytest.raises(ConfigError) as err:
            config_from_overrides([*base, f"learners.standby={value}"])
        assert err.value.field == field_name


# ---- in a running experiment ----------------------------------------------------------------

@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), ["learners.standby=1"])
        h.start()
        yield h


def _supervise(h: Harness, cursor=None):
    context = dg.build_sensor_context(instance=h.instance, cursor=cursor,
                                      resources={"store": h.resource})
    return supervise_tick(context, h.resource, now=h.now)


def _launched(result) -> list[str]:
    return sorted(r.tags["diloco/learner"] for r in result.run_requests)


def test_a_standby_learner_is_launched_only_once_it_joins_and_gets_its_partition(harness):
    h = harness
    assert h.instance.get_dynamic_partitions("learners") == ["exp-test/learner-0",
                                                            "exp-test/learner-1"]
    first = _supervise(h)
    assert _launched(first) == ["learner-0", "learner-1"]
    assert not first.dynamic_partitions_requests
    assert main(["capacity", "--store", h.resource.base_uri, "--join", "learner-2",
                 "--reason", "spot capacity"]) == 0
    joined = _supervise(h)
    assert "learner-2" in _launched(joined)
    (request,) = joined.dynamic_partitions_requests
    assert request.partitions_def_name == "learners"
    assert list(request.partition_keys) == ["exp-test/learner-2"]
    change = current_capacity(h.store, h.cfg).changes[-1]
    assert (change.learner, change.action, change.reason) == ("learner-2", "join",
                                                              "spot capacity")


def test_a_departed_learner_is_not_relaunched_and_no_round_waits_for_it(harness, capsys):
    h = harness
    for name in ("learner-0", "learner-1"):
        h.beat(name, 8)
    h.tick()   # round 0 opens (fragment 0)
    # K = 2: learner-1 may leave only once learner-2 has joined.
    assert main(["capacity", "--store", h.resource.base_uri, "--leave", "learner-1"]) == 2
    assert "fewer than the 2 needed (sync.min_quorum)" in capsys.readouterr().err
    assert main(["capacity", "--store", h.resource.base_uri, "--join", "learner-2",
                 "--leave", "learner-1"]) == 0
    assert "2 of 3 learners present (learner-0, learner-2)" in capsys.readouterr().out
    # Still beating "training" (it has not read the request yet): not live all the same, so
    # the round merges on learner-0's offer without waiting for it.
    h.offer("learner-0", 0)
    h.offer("learner-2", 0)
    h.beat("learner-1", 1)
    h.tick(advance=3.0)   # past the capacity record's read interval
    h.tick()
    decision = h.store.get_decision(0)
    assert list(decision.members) == ["learner-0", "learner-2"]
    assert "learner-1" not in decision.missing and "learner-1" not in decision.live
    assert "learner-1" not in _launched(_supervise(h))
    # Refused with a reason, nothing written: unknown learner, already absent.
    assert main(["capacity", "--store", h.resource.base_uri, "--leave", "learner-7"]) == 2
    assert "not on the roster" in capsys.readouterr().err
    assert main(["capacity", "--store", h.resource.base_uri, "--leave", "learner-1"]) == 2
    assert "already absent" in capsys.readouterr().err
    assert current_capacity(h.store, h.cfg).absent == ("learner-1",)


def test_the_capacity_job_changes_it_from_the_ui(harness):
    h = harness
    result = h.defs.resolve_job_def("capacity").execute_in_process(
        instance=h.instance, tags={"diloco/experiment": h.store.experiment},
        run_config={"ops": {"change_run_capacity": {"config": {
            "join": ["learner-2"], "leave": ["learner-0"], "reason": "rebalance"}}}})
    assert result.success
    record = current_capacity(h.store, h.cfg)
    assert record.absent == ("learner-0",)
    assert [c.by.startswith("Dagster run") for c in record.changes] == [True, True]
    bad = h.defs.resolve_job_def("capacity").execute_in_process(
        instance=h.instance, raise_on_error=False,
        run_config={"ops": {"change_run_capacity": {"config": {"join": ["learner-2"]}}}})
    assert not bad.success
    assert current_capacity(h.store, h.cfg) == record   # nothing written


def test_a_tapes_capacity_changes_apply_once_when_their_round_opens(tmp_path):
    tape = tmp_path / "tape.json"
    tape.write_text(json.dumps({"faults": [
        {"id": "join-2", "kind": "learner_join", "learner": "learner-2", "at_round": 1},
        {"id": "leave-0", "kind": "learner_leave", "learner": "learner-0", "at_round": 3}]}))
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), ["learners.standby=1"])
        h.start(fault_tape_path=str(tape))
        loaded = load_tape(h.store, list(h.cfg.learners.learner_names))
        assert apply_tape(h.store, h.cfg, loaded, None) == []
        assert apply_tape(h.store, h.cfg, loaded, 0) == []
        assert apply_tape(h.store, h.cfg, loaded, 2) == ["join-2: learner-2 joins at round 2"]
        assert apply_tape(h.store, h.cfg, loaded, 2) == []          # fired once
        assert current_capacity(h.store, h.cfg).absent == ()
        # The supervisor applies the rest as round 3 opens.
        h.store.open_round(3, {"fragment": 1, "opened_at": h.now, "final": False})
        result = _supervise(h)
        assert current_capacity(h.store, h.cfg).absent == ("learner-0",)
        assert "learner-0" not in _launched(result)
        assert {f["id"] for f in h.store.fired_faults()} == {"join-2", "leave-0"}


RACER = textwrap.dedent("""
    import sys
    from diloco_core.capacity import CapacityError
    from diloco_core.config_loading import config_from_mapping
    from pipelines.capacity_control import change_capacity
    from resources.store.resource import ArtifactStoreResource
    store = ArtifactStoreResource(base_uri=sys.argv[1]).store(sys.argv[2])
    cfg = config_from_mapping(store.get_config())
    for i in range(int(sys.argv[4])):
        change_capacity(store, cfg, leave=[sys.argv[3]], requested_by=sys.argv[3])
        change_capacity(store, cfg, join=[sys.argv[3]], requested_by=sys.argv[3])
""")


def test_two_operators_changing_capacity_at_once_lose_no_change(tmp_path):
    # Two real processes, each toggling its own learner; every change is a conditional write
    # retried on conflict, so the history has all of them, in an order each process agrees on.
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), ["learners.num_learners=4"])
        h.start()
        _race(h)


def _race(h: Harness) -> None:
    rounds = 12
    racers = [subprocess.Popen([sys.executable, "-c", RACER, h.resource.base_uri,
                                h.store.experiment, name, str(rounds)],
                               stderr=subprocess.PIPE, text=True)
              for name in ("learner-0", "learner-1")]
    for racer in racers:
        _, err = racer.communicate(timeout=240)
        assert racer.returncode == 0, err
    record = current_capacity(h.store, h.cfg)
    assert record.absent == ()
    assert len(record.changes) == 4 * rounds
    for name in ("learner-0", "learner-1"):
        mine = [c.action for c in record.changes if c.learner == name]
        assert mine == ["leave", "join"] * rounds


def test_a_change_to_a_finished_or_stopping_run_is_refused(harness):
    h = harness
    h.store.put_stop_request({"reason": "test"})
    with pytest.raises(CapacityError, match="stopping"):
        change_capacity(h.store, h.cfg, join=["learner-2"], requested_by="test")
