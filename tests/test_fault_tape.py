"""Fault tapes: a valid tape round-trips and is queryable; an invalid one names what is wrong."""

import copy
import itertools
import math

import pytest

from diloco_core.fault_tape import (
    DAGSTER_KINDS,
    FAULT_KINDS,
    TapeError,
    kill_loop_tape,
    tape_from_mapping,
)

LEARNERS = ("l0", "l1")

# One fault of every kind, with non-default parameters where a kind takes any. The Dagster
# restarts are deliberately out of time order.
FULL = {
    "seed": 7,
    "faults": [
        {"id": "kill", "kind": "learner_kill", "learner": "l0", "at_step": 12},
        {"id": "hang", "kind": "learner_hang", "learner": "l1", "at_step": 3,
         "params": {"seconds": "inf"}},
        {"id": "slow", "kind": "learner_slow", "learner": "l0", "at_step": 0,
         "params": {"factor": 2.5, "steps": "inf"}},
        {"id": "skew", "kind": "clock_skew", "learner": "l1", "at_step": 5,
         "params": {"seconds": -120.0}},
        {"id": "hostile", "kind": "hostile_records", "learner": "l1", "at_step": 5,
         "params": {"every_steps": 3, "steps": "inf"}},
        {"id": "store", "kind": "store_errors", "learner": "l0", "at_step": 20,
         "params": {"rate": 0.5, "steps": 10, "kinds": ["timeout"], "slow_seconds": 0.1}},
        {"id": "bad", "kind": "bad_contribution", "learner": "l1", "at_round": 2,
         "params": {"mode": "wrong_shape"}},
        {"id": "crash", "kind": "merge_crash", "at_round": 3,
         "params": {"phase": "during_commit"}},
        {"id": "merge-store", "kind": "merge_store_errors", "at_round": 4,
         "params": {"rate": 1, "kinds": ["slow"]}},
        {"id": "syncer-kill", "kind": "syncer_kill", "at_round": 5},
        {"id": "syncer-hang", "kind": "syncer_hang", "at_round": 6,
         "params": {"seconds": "inf"}},
        {"id": "webserver", "kind": "webserver_restart", "at_seconds": 90.5},
        {"id": "daemon", "kind": "daemon_restart", "at_seconds": 30},
        {"id": "instance", "kind": "instance_restart", "at_seconds": 60.0},
        {"id": "leave", "kind": "learner_leave", "learner": "l0", "at_round": 9},
        {"id": "join", "kind": "learner_join", "learner": "l1", "at_round": 4},
    ],
}


def _tape_with(*faults, learners=LEARNERS):
    return tape_from_mapping({"faults": list(faults)}, learners)


def _kill(**extra):
    return {"id": "k", "kind": "learner_kill", "learner": "l0", "at_step": 1, **extra}


# --- valid tapes -------------------------------------------------------------------------

def test_full_tape_covers_every_kind_and_round_trips():
    tape = tape_from_mapping(FULL, LEARNERS)
    assert {f.kind for f in tape.faults} == set(FAULT_KINDS)
    assert tape.seed == 7
    # "inf" is parsed to a float and written back as "inf", so JSON can carry it.
    assert tape.faults[1].params["seconds"] == math.inf
    assert tape.to_mapping()["faults"][1]["params"] == {"seconds": "inf"}
    assert tape_from_mapping(tape.to_mapping(), LEARNERS) == tape
    # Capacity changes, in the order they take effect; never handed to a learner's injector.
    assert [f.id for f in tape.capacity_changes()] == ["join", "leave"]
    assert all(f.kind not in ("learner_join", "learner_leave") for f in tape.for_learner("l0"))


def test_parsing_does_not_mutate_the_input():
    data = copy.deepcopy(FULL)
    tape_from_mapping(data, LEARNERS)
    assert data == FULL


def test_count_for_learner_and_at_round():
    tape = tape_from_mapping(FULL, LEARNERS)
    assert tape.count() == dict.fromkeys(FAULT_KINDS, 1)
    assert [f.id for f in tape.for_learner("l0")] == ["kill", "slow", "store"]
    # bad_contribution names a learner but is a round fault, not a learner-process fault.
    assert [f.id for f in tape.for_learner("l1")] == ["hang", "skew", "hostile"]
    assert tape.for_learner("l9") == ()
    assert [f.id for f in tape.at_round("bad_contribution", 2)] == ["bad"]
    assert [f.id for f in tape.at_round("bad_contribution", 2, "l1")] == ["bad"]
    assert tape.at_round("bad_contribution", 2, "l0") == ()
    assert tape.at_round("bad_contribution", 3) == ()
    assert [f.id for f in tape.at_round("merge_crash", 3)] == ["crash"]


def test_dagster_faults_are_sorted_by_time():
    tape = tape_from_mapping(FULL, LEARNERS)
    restarts = tape.dagster_faults()
    assert [f.id for f in restarts] == ["daemon", "instance", "webserver"]
    assert [f.at_seconds for f in restarts] == [30, 60.0, 90.5]
    assert {f.kind for f in restarts} == set(DAGSTER_KINDS)


def test_params_fall_back_to_the_kind_defaults():
    tape = _tape_with({"id": "s", "kind": "learner_slow", "learner": "l0", "at_step": 1},
                      {"id": "c", "kind": "merge_crash", "at_round": 0})
    slow, crash = tape.faults
    assert (slow.param("factor"), slow.param("steps")) == (4.0, 50)
    assert crash.param("phase") == "before_commit"
    # Defaults are not written out: the tape stays as the author wrote it.
    assert "params" not in slow.to_mapping()


def test_missing_id_gets_a_valid_default_and_learners_are_optional():
    tape = tape_from_mapping({"faults": [{"kind": "learner_kill", "learner": "anyone",
                                          "at_step": 0}]})
    assert tape.seed is None
    assert tape.faults[0].id == "f000-learner_kill"
    assert tape_from_mapping(tape.to_mapping()) == tape


def test_clock_skew_may_be_negative():
    tape = _tape_with({"id": "s", "kind": "clock_skew", "learner": "l0", "at_step": 0,
                       "params": {"seconds": -3600}})
    assert tape.faults[0].param("seconds") == -3600


def test_merge_crashes_at_different_phases_or_rounds_are_fine():
    tape = _tape_with({"id": "a", "kind": "merge_crash", "at_round": 1},
                      {"id": "b", "kind": "merge_crash", "at_round": 1,
                       "params": {"phase": "after_commit"}},
                      {"id": "c", "kind": "merge_crash", "at_round": 2})
    assert tape.count() == {"merge_crash": 3}


# --- invalid tapes: the message names the field and the reason ------------------------------

def test_unknown_top_level_field():
    with pytest.raises(TapeError, match=r"unknown field.*'fautls'"):
        tape_from_mapping({"fautls": []})


def test_faults_must_be_a_list():
    with pytest.raises(TapeError, match="faults must be a list"):
        tape_from_mapping({"faults": {"id": "k"}})


def test_unknown_fault_field():
    with pytest.raises(TapeError, match=r"faults\[0\]: unknown field.*'step'"):
        _tape_with(_kill(step=3))


def test_unknown_kind():
    with pytest.raises(TapeError, match=r"faults\[0\]\.kind: 'learner_explode'"):
        _tape_with(_kill(kind="learner_explode"))


def test_duplicate_id():
    with pytest.raises(TapeError, match=r"faults\[1\]\.id: duplicate id 'k'"):
        _tape_with(_kill(), _kill(at_step=9))


@pytest.mark.parametrize("bad_id", ["../x", "A", "", "-x", "x" * 64, 3])
def test_unsafe_id(bad_id):
    # Ids become store keys: no path separators, upper case, or leading punctuation.
    with pytest.raises(TapeError, match=r"faults\[0\]\.id: use 1-63 characters"):
        _tape_with(_kill(id=bad_id))


def test_learner_must_belong_to_the_experiment():
    with pytest.raises(TapeError, match=r"faults\[0\]\.learner: 'l7' is not a learner"):
        _tape_with(_kill(learner="l7"))


def test_learner_fault_needs_a_learner_and_a_round_fault_refuses_one():
    with pytest.raises(TapeError, match=r"\.learner: required for learner_kill"):
        _tape_with({"id": "k", "kind": "learner_kill", "at_step": 1})
    with pytest.raises(TapeError, match=r"\.learner: merge_crash does not take a learner"):
        _tape_with({"id": "c", "kind": "merge_crash", "learner": "l0", "at_round": 1})


def test_missing_trigger():
    with pytest.raises(TapeError, match=r"\.at_step: learner_kill needs a number >= 0"):
        _tape_with({"id": "k", "kind": "learner_kill", "learner": "l0"})
    with pytest.raises(TapeError, match=r"\.at_seconds: daemon_restart needs a number"):
        _tape_with({"id": "d", "kind": "daemon_restart"})


def test_wrong_trigger_for_the_kind():
    with pytest.raises(TapeError, match=r"\.at_round: learner_kill is not triggered by at_round"):
        _tape_with(_kill(at_round=2))
    with pytest.raises(TapeError, match=r"\.at_step: merge_crash is not triggered by at_step"):
        _tape_with({"id": "c", "kind": "merge_crash", "at_round": 1, "at_step": 1})


@pytest.mark.parametrize("value", [-1, True, math.nan, "3", None])
def test_bad_at_step(value):
    # Steps are whole numbers; a bool is not a step even though it is an int.
    with pytest.raises(TapeError, match=r"\.at_step: learner_kill needs a number >= 0"):
        _tape_with(_kill(at_step=value))


@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf, False])
def test_bad_at_seconds(value):
    with pytest.raises(TapeError, match=r"\.at_seconds: daemon_restart needs a number"):
        _tape_with({"id": "d", "kind": "daemon_restart", "at_seconds": value})


def test_unknown_param():
    with pytest.raises(TapeError, match=r"\.params\.speed: learner_slow takes factor, steps"):
        _tape_with({"id": "s", "kind": "learner_slow", "learner": "l0", "at_step": 0,
                    "params": {"speed": 2}})
    with pytest.raises(TapeError, match=r"\.params\.x: learner_kill takes no parameters"):
        _tape_with(_kill(params={"x": 1}))


@pytest.mark.parametrize("params", [["factor", 2.0], "factor=2", 3])
def test_params_must_be_a_mapping(params):
    with pytest.raises(TapeError, match=r"faults\[0\]\.params: a mapping"):
        _tape_with({"id": "s", "kind": "learner_slow", "learner": "l0", "at_step": 0,
                    "params": params})


def test_empty_list_params_is_not_a_mapping_either():
    with pytest.raises(TapeError, match=r"\.params: a mapping"):
        _tape_with(_kill(params=[]))


def test_bad_mode_and_phase():
    with pytest.raises(TapeError, match=r"\.params\.mode: 'zeros' is not one of nan"):
        _tape_with({"id": "b", "kind": "bad_contribution", "learner": "l0", "at_round": 0,
                    "params": {"mode": "zeros"}})
    with pytest.raises(TapeError, match=r"\.params\.phase: 'mid_commit' is not one of"):
        _tape_with({"id": "c", "kind": "merge_crash", "at_round": 0,
                    "params": {"phase": "mid_commit"}})


@pytest.mark.parametrize("kinds", [[], ["transient", "eof"], "timeout"])
def test_bad_store_error_kinds(kinds):
    with pytest.raises(TapeError, match=r"\.params\.kinds: a non-empty list"):
        _tape_with({"id": "m", "kind": "merge_store_errors", "at_round": 0,
                    "params": {"kinds": kinds}})


@pytest.mark.parametrize("rate", [-0.1, 1.5, True, math.nan, "0.5", "inf"])
def test_rate_must_be_a_fraction(rate):
    with pytest.raises(TapeError, match=r"\.params\.rate: "):
        _tape_with({"id": "s", "kind": "store_errors", "learner": "l0", "at_step": 0,
                    "params": {"rate": rate}})


@pytest.mark.parametrize("rate", [0, 0.0, 1, 1.0])
def test_rate_bounds_are_inclusive(rate):
    _tape_with({"id": "s", "kind": "store_errors", "learner": "l0", "at_step": 0,
                "params": {"rate": rate}})


@pytest.mark.parametrize("factor", [0.5, 0, -2])
def test_factor_below_one_is_refused(factor):
    # A "slowdown" that speeds the learner up is a mistake in the tape.
    with pytest.raises(TapeError, match=r"\.params\.factor: "):
        _tape_with({"id": "s", "kind": "learner_slow", "learner": "l0", "at_step": 0,
                    "params": {"factor": factor}})


@pytest.mark.parametrize("kind, name", [("learner_hang", "seconds"), ("learner_slow", "steps"),
                                        ("store_errors", "steps")])
def test_inf_is_accepted_for_the_unbounded_params(kind, name):
    tape = _tape_with({"id": "x", "kind": kind, "learner": "l0", "at_step": 0,
                       "params": {name: "inf"}})
    assert tape.faults[0].param(name) == math.inf


@pytest.mark.parametrize("kind, name", [("store_errors", "slow_seconds"),
                                        ("learner_slow", "factor"),
                                        ("clock_skew", "seconds"),
                                        ("store_errors", "rate")])
def test_inf_is_refused_elsewhere(kind, name):
    with pytest.raises(TapeError, match=rf"\.params\.{name}: only .* may be \"inf\""):
        _tape_with({"id": "x", "kind": kind, "learner": "l0", "at_step": 0,
                    "params": {name: "inf"}})


@pytest.mark.parametrize("kind, name", [("store_errors", "slow_seconds"),
                                        ("learner_slow", "factor"),
                                        ("clock_skew", "seconds")])
def test_a_float_infinity_is_refused_where_inf_is(kind, name):
    # The string is not the only way in: a parsed float('inf') must be refused too.
    with pytest.raises(TapeError, match=rf"\.params\.{name}: "):
        _tape_with({"id": "x", "kind": kind, "learner": "l0", "at_step": 0,
                    "params": {name: math.inf}})


@pytest.mark.parametrize("steps", [2.5, True, -1, math.nan])
def test_steps_must_be_a_whole_number(steps):
    with pytest.raises(TapeError, match=r"\.params\.steps: "):
        _tape_with({"id": "s", "kind": "learner_slow", "learner": "l0", "at_step": 0,
                    "params": {"steps": steps}})


def test_two_merge_crashes_at_the_same_round_and_phase_are_refused():
    with pytest.raises(TapeError, match=r"faults\[1\]: a second merge_crash at round 3"):
        _tape_with({"id": "a", "kind": "merge_crash", "at_round": 3,
                    "params": {"phase": "after_commit"}},
                   {"id": "b", "kind": "merge_crash", "at_round": 3,
                    "params": {"phase": "after_commit"}})
    # The default phase is the same phase as writing it out.
    with pytest.raises(TapeError, match="a second merge_crash at round 0, phase before_commit"):
        _tape_with({"id": "a", "kind": "merge_crash", "at_round": 0},
                   {"id": "b", "kind": "merge_crash", "at_round": 0,
                    "params": {"phase": "before_commit"}})


def test_non_mapping_tape_fault_and_seed():
    with pytest.raises(TapeError, match="expected an object"):
        tape_from_mapping([])
    with pytest.raises(TapeError, match=r"faults\[0\]: expected an object"):
        tape_from_mapping({"faults": ["learner_kill"]})
    with pytest.raises(TapeError, match="seed must be an integer"):
        tape_from_mapping({"seed": True, "faults": []})


# --- the soak's kill loop ------------------------------------------------------------------

KILL_LOOP = dict(learners=["learner-0", "learner-1", "learner-2"], steps=200, kills=6,
                 min_gap_steps=20, first_step=20,
                 restarts=[("daemon_restart", 40.0), ("instance_restart", 10)])


def test_kill_loop_is_deterministic_in_its_seed():
    assert kill_loop_tape(1, **KILL_LOOP) == kill_loop_tape(1, **KILL_LOOP)
    assert kill_loop_tape(1, **KILL_LOOP) != kill_loop_tape(2, **KILL_LOOP)


@pytest.mark.parametrize("seed", range(10))
def test_kill_loop_places_kills_as_asked(seed):
    tape = kill_loop_tape(seed, **KILL_LOOP)
    kills = [f for f in tape.faults if f.kind == "learner_kill"]
    assert len(kills) == KILL_LOOP["kills"]
    assert tape.count()["learner_kill"] == KILL_LOOP["kills"]
    assert all(KILL_LOOP["first_step"] <= f.at_step < KILL_LOOP["steps"] for f in kills)
    for name in KILL_LOOP["learners"]:
        steps = sorted(f.at_step for f in tape.for_learner(name))
        gaps = [b - a for a, b in itertools.pairwise(steps)]
        assert all(gap >= KILL_LOOP["min_gap_steps"] for gap in gaps)
    # The tape it writes is one the validator accepts, unchanged.
    assert tape_from_mapping(tape.to_mapping(), KILL_LOOP["learners"]) == tape


def test_kill_loop_carries_the_restarts():
    tape = kill_loop_tape(3, **KILL_LOOP)
    restarts = tape.dagster_faults()
    assert [(f.kind, f.at_seconds) for f in restarts] == [("instance_restart", 10.0),
                                                          ("daemon_restart", 40.0)]
    assert all(f.learner is None and f.at_step is None for f in restarts)


def test_kill_loop_refuses_an_impossible_placement():
    # One learner, 10 steps, kills 5 apart: at most 2 fit.
    with pytest.raises(TapeError, match="cannot place 3 kills 5 steps apart"):
        kill_loop_tape(0, ["a"], steps=10, kills=3, min_gap_steps=5)


def test_kill_loop_with_no_kills_is_only_restarts():
    tape = kill_loop_tape(0, ["a"], steps=10, kills=0, min_gap_steps=5,
                          restarts=[("webserver_restart", 5)])
    assert tape.count() == {"webserver_restart": 1}


def test_kill_loop_needs_a_gap_so_that_no_step_is_drawn_twice():
    # Two kills of one learner at one step would share an id (and only one could fire).
    with pytest.raises(TapeError, match="min_gap_steps must be >= 1"):
        kill_loop_tape(0, ["a"], steps=3, kills=5, min_gap_steps=0)


def test_kill_loop_refuses_an_empty_window_with_a_tape_error():
    with pytest.raises(TapeError, match=r"no steps in \[first_step=10, steps=10\)"):
        kill_loop_tape(0, ["a"], steps=10, kills=1, min_gap_steps=1, first_step=10)
    with pytest.raises(TapeError, match="no learners"):
        kill_loop_tape(0, [], steps=10, kills=1, min_gap_steps=1)


def test_kill_loop_refuses_an_unknown_restart_kind():
    with pytest.raises(TapeError, match="'daemon_restrat' is not one of daemon_restart"):
        kill_loop_tape(0, ["a"], steps=10, kills=0, min_gap_steps=1,
                       restarts=[("daemon_restrat", 5.0)])


def test_the_documented_example_tape_is_valid_and_uses_every_kind():
    # docs/chaos.md shows one tape "valid for the 4 learners of the embedded defaults".
    import json
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "chaos.md").read_text()
    example = json.loads(text.split("```json\n", 1)[1].split("```", 1)[0])
    tape = tape_from_mapping(example, [f"learner-{i}" for i in range(4)])
    assert {f.kind for f in tape.faults} == set(FAULT_KINDS)


# --- the tape in the store: honoured only in a chaos run, refused with a reason if malformed -----

def _store_with(tmp_path, chaos: bool, tape: bytes | None):
    from resources.store import layout
    from resources.store.artifact_store import ArtifactStore
    from resources.store.blobs import LocalBlobStore

    store = ArtifactStore(LocalBlobStore(tmp_path / "store"), "exp")
    store.put_config({"name": "exp", "orchestration": {"chaos": chaos}})
    if tape is not None:   # raw: whatever is there, as something other than `train` wrote it
        store.blobs.write(layout.fault_tape("exp"), tape)
    return store


@pytest.mark.parametrize(("body", "reason"), [
    (b"[1, 2]", "not a JSON object"),
    (b"\x00{", "not valid JSON"),
    (b'{"faults": [{"kind": "learner_explode", "learner": "l0", "at_step": 1}]}',
     "faults[0].kind: 'learner_explode' is not one of"),
    (b'{"faults": [{"kind": "learner_kill", "learner": "l9", "at_step": 1}]}',
     "faults[0].learner: 'l9' is not a learner of this experiment"),
    (b'{"faults": "all"}', "faults must be a list"),
])
def test_a_malformed_tape_in_the_store_is_refused_with_a_reason_never_raised(tmp_path, body,
                                                                             reason):
    from resources.chaos.faults import load_tape

    store = _store_with(tmp_path, chaos=True, tape=body)
    said = []
    assert load_tape(store, list(LEARNERS), log=said.append) is None
    assert len(said) == 1 and "fault tape refused, no fault is injected" in said[0], said
    assert reason in said[0], said


def test_a_tape_is_honoured_only_in_an_experiment_launched_as_a_chaos_run(tmp_path):
    import json

    from resources.chaos.faults import load_tape

    body = json.dumps(FULL).encode()
    production = _store_with(tmp_path / "p", chaos=False, tape=body)
    said = []
    assert load_tape(production, list(LEARNERS), log=said.append) is None
    assert said == ["fault tape ignored: experiment 'exp' was not launched as a chaos run "
                    "(orchestration.chaos is false in its config)"]
    # The caller's own reading of the config decides too (the supervisor has it at hand).
    assert load_tape(production, list(LEARNERS), chaos=False, log=said.append) is None
    chaos = _store_with(tmp_path / "c", chaos=True, tape=body)
    said = []
    assert load_tape(chaos, list(LEARNERS), log=said.append) == tape_from_mapping(FULL, LEARNERS)
    assert said == []
    nothing = _store_with(tmp_path / "n", chaos=False, tape=None)
    assert load_tape(nothing, log=said.append) is None and said == []   # no tape: nothing to say


def test_the_learner_supervisor_tick_survives_a_malformed_tape(tmp_path):
    """A malformed tape made every learner-supervisor tick raise: no learner was launched
    again. Now the tick logs the refusal and goes on."""
    import dagster as dg
    from orchestration_harness import Harness

    from pipelines.defs.supervise_tick import supervise_tick
    from resources.store import layout

    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), ["orchestration.chaos=true"])
        h.start()
        h.store.blobs.write(layout.fault_tape(h.store.experiment),
                            b'{"faults": [{"kind": "learner_kill", "at_step": "soon"}]}')
        context = dg.build_sensor_context(instance=h.instance, resources={"store": h.resource})
        result = supervise_tick(context, h.resource, now=h.now)
        assert sorted(r.tags["diloco/learner"] for r in result.run_requests) == [
            "learner-0", "learner-1", "learner-2"]


def test_the_train_job_refuses_a_tape_for_an_experiment_that_is_not_a_chaos_run(tmp_path):
    import json

    import dagster as dg
    from orchestration_harness import Harness

    tape = tmp_path / "tape.json"
    tape.write_text(json.dumps({"faults": [{"kind": "learner_kill", "learner": "learner-0",
                                            "at_step": 3}]}))
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"))
        result = h.defs.resolve_job_def("train").execute_in_process(
            instance=instance, raise_on_error=False,
            run_config={"ops": {"start_experiment": {"config": {
                "overrides": h.overrides, "orchestrated_defaults": False,
                "fault_tape_path": str(tape)}}}})
        assert not result.success
        failure = result.get_step_failure_events()[0].step_failure_data.user_failure_data
        assert failure.description.startswith(
            "fault_tape_path: a fault tape is injected only into a chaos run")
        assert not (tmp_path / "store" / "experiments").exists()     # nothing was written
