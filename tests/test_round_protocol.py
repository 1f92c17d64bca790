"""The round protocol (`diloco_core.round_protocol`) and its records (`round_records`).

The rules are pure and tested as such; the contract test drives one scripted sequence of
learner records (progress, offers, a late offer, a dead learner, K < M, STOP, a learner that
declines a final round) through both deciders that run them on the orchestrated path, the
syncer service and the quorum sensor's fallback (merge runs), and compares what they decided
with each other and with what the protocol says.
"""

import dataclasses
import json

import dagster as dg
import pytest
from orchestration_harness import JUMPS, Harness

from diloco_core.config import ConfigError
from diloco_core.config_loading import config_from_mapping, overrides_to_mapping
from diloco_core.quorum import Estimates
from diloco_core.round_protocol import (
    budget_reached,
    decide_round,
    held_by_pacing,
    offer_choice,
    ready_to_open,
    tokens_needed,
)
from diloco_core.round_records import Heartbeat, RecordError, RoundDecision, RoundOpen
from pipelines.syncer.round_control import RoundController
from pipelines.syncer.service import SyncerService
from resources.store import layout

NAMES = ["learner-0", "learner-1", "learner-2"]


def load_config(overrides):
    return config_from_mapping(overrides_to_mapping(overrides))


# ---- the rules ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    ((5, False, 5, 3, False), "answered"),       # this round was offered (or declined) already
    ((5, False, 4, 3, True), "wait"),            # an offer of this fragment is in flight
    ((5, True, 4, 3, True), "wait"),             # ... even in a final round: its merge comes
    ((5, False, 4, 0, False), "wait"),           # nothing new: offer after the next step
    ((5, True, 4, 0, False), "decline"),         # nothing new and never will be: decline
    ((5, False, 4, 0, False, True), "decline"),  # ... the round open at STOP: trains no more
    ((5, False, 4, 1, False, True), "offer"),    # ... unless it has news for it
    ((5, False, 4, 0, True, True), "wait"),      # ... or an offer's merge is still to come
    ((5, False, 4, 1, False), "offer"),
])
def test_offer_choice(args, expected):
    assert offer_choice(*args) == expected


def test_a_round_opens_once_the_previous_is_decided_and_k_live_learners_progressed():
    cfg = load_config(overrides=["learners.num_learners=3", "sync.min_quorum=2",
                                 "sync.num_fragments=2", "sync.sync_period=4"])
    needed = tokens_needed(cfg)
    step = cfg.learner_step_tokens[0]
    assert needed == {n: 2 * step for n in NAMES}            # H/P = 2 steps
    progressed = {"learner-0": 2 * step, "learner-1": 2 * step, "learner-2": step}
    assert ready_to_open(progressed, needed, NAMES, 2, previous_decided=True)
    assert not ready_to_open(progressed, needed, NAMES, 2, previous_decided=False)
    # A dead learner's progress does not count.
    assert not ready_to_open(progressed, needed, ["learner-0", "learner-2"], 2, True)
    assert budget_reached({"a": 60, "b": 40}, 100) and not budget_reached({"a": 99}, 100)


def test_after_stop_a_round_waits_for_every_live_learner_that_did_not_decline():
    cfg = load_config(overrides=["learners.num_learners=3", "sync.min_quorum=2",
                                 "orchestration.round_timeout_seconds=30"])
    est = Estimates(step_seconds=1.0)
    arrivals = {"learner-0": 1.0}
    waiting = decide_round(2.0, arrivals, NAMES, est, cfg, stopping=True, opened_at=0.0,
                           declined=["learner-1"])
    assert not waiting.merge and waiting.missing == ("learner-2",)
    done = decide_round(2.0, arrivals, ["learner-0", "learner-1"], est, cfg, stopping=True,
                        opened_at=0.0, declined=["learner-1"])
    assert done.merge and done.members == ("learner-0",) and not done.missing
    assert "learner-1: nothing new" in done.reason
    timed_out = decide_round(31.0, arrivals, NAMES, est, cfg, stopping=True, opened_at=0.0)
    assert timed_out.merge and timed_out.missing == ("learner-1", "learner-2")
    # Before STOP the quorum policy decides: 1 of K = 2 offers is not enough.
    assert not decide_round(2.0, arrivals, NAMES, est, cfg, stopping=False, opened_at=0.0).merge


# ---- the records --------------------------------------------------------------------------------
def test_records_round_trip_and_drop_unknown_keys():
    decision = RoundDecision(round=3, fragment=1, members=("a", "b"), reason="quorum",
                             decided_at=5.0, arrivals={"a": 1.0, "b": 2.0}, grace_seconds=0.5)
    assert RoundDecision.from_json(json.loads(json.dumps(decision.to_json()))) == decision
    opened = RoundOpen(round=2, fragment=0, opened_at=1.5, learner_tokens={"a": 10})
    assert RoundOpen.from_json({**opened.to_json(), "extra": "x"}) == opened
    assert "extra" not in RoundOpen.from_json({**opened.to_json(), "extra": "x"}).to_json()


@pytest.mark.parametrize("field, value, reason", [
    ("tokens_total", "lots", "must be an integer"),
    ("tokens_total", 10 ** 30, "must be in"),
    ("tokens_total", -1, "must be in"),
    ("attempt", True, "must be an integer"),
    ("time", float("inf"), "finite"),
    ("loss", 1e400, "finite"),                   # JSON's 1e400 parses as inf
    ("declined_rounds", list(range(100)), "more than 64"),
    ("status", "x" * 1000, "longer than"),
])
def test_a_malformed_heartbeat_is_refused_naming_the_field(field, value, reason):
    beat = {"learner": "a", "status": "training", "time": 1.0, field: value}
    with pytest.raises(RecordError) as err:
        Heartbeat.from_json(beat)
    assert err.value.field == field and reason in err.value.reason


@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"))
        h.start()
        yield h


@pytest.mark.parametrize("body", [
    '{"learner": "learner-1", "status": "training", "time": 1, "tokens_total": 1' + "0" * 5000
    + "}",
    "[" * 100_000 + "]" * 100_000,
    '{"status": "training", "time": 1, "tokens_total": "lots"}',
    '"just a string"',
])
def test_a_hostile_heartbeat_reads_as_none_and_the_round_goes_on(harness, body):
    """One learner's record must never stop the control plane: the other two open and decide
    round 0 while learner-1's heartbeat is refused, with the reason in the tick's report."""
    h = harness
    for name in NAMES:
        h.beat(name, 2)
    h.store.blobs.write(layout.heartbeat(h.store.experiment, "learner-1"), body.encode())
    beat, why = h.store.read_heartbeat("learner-1")
    assert beat is None and why
    controller = RoundController(h.store)
    h.now += 1
    result = controller.tick(None, now=h.now)
    assert result.opened == [0] and "heartbeats refused: learner-1" in result.reason
    for name in ("learner-0", "learner-2"):
        h.offer(name, 0)
    h.now += 1
    result = controller.tick(result.state, now=h.now)
    assert [list(m.members) for m in result.merges] == [["learner-0", "learner-2"]]


# ---- the contract: the syncer service and the sensor fallback decide alike ----------------------
def _scenario(h: Harness, decide) -> None:
    """One scripted run: M = 3, K = 2, P = 2, grace 0, two rounds, a late offer, a learner that
    dies, STOP, a final round declined by one learner, the last final round, finished."""
    def step() -> None:
        h.now += 1
        decide()

    for name in NAMES:
        h.beat(name, 0)
    step()                                                  # nobody progressed: no round
    for name in NAMES:
        h.beat(name, 2)
    step()                                                  # round 0 opens (fragment 0)
    h.offer("learner-0", 0)
    h.offer("learner-1", 0)
    step()                                                  # K = 2 offered: decided
    h.offer("learner-2", 0)                                 # late: after the decision
    h.beat("learner-2", 0, status="failed")                 # ... and then it dies
    for name in ("learner-0", "learner-1"):
        h.beat(name, 2)
    step()                                                  # round 1 opens (fragment 1)
    h.offer("learner-1", 1)
    step()                                                  # 1 of 2: waiting for quorum
    h.offer("learner-0", 1)
    step()                                                  # decided, in arrival order
    for name in ("learner-0", "learner-1"):
        h.beat(name, 400)                                   # past the token budget
    step()                                                  # STOP; final round 2 opens
    h.offer("learner-0", 2)
    h.store.put_heartbeat("learner-1", dataclasses.replace(
        h.store.get_heartbeat("learner-1"), time=h.now, declined_rounds=(2,)))
    step()                                                  # round 2 decided; round 3 opens
    h.offer("learner-0", 3)
    h.offer("learner-1", 3)
    step()                                                  # round 3 decided
    step()                                                  # its merge is published: finished
    step()


EXPECTED = [  # (round, fragment, final, members, missing, declined)
    (0, 0, False, ["learner-0", "learner-1"], ["learner-2"], []),
    (1, 1, False, ["learner-1", "learner-0"], [], []),
    (2, 0, True, ["learner-0"], [], ["learner-1"]),
    (3, 1, True, ["learner-0", "learner-1"], [], []),
]


def _decided(h: Harness) -> list[tuple]:
    out = []
    for r in range(6):
        d = h.store.get_decision(r)
        if d is not None:
            out.append((d.round, d.fragment, d.final, list(d.members), list(d.missing),
                        list(d.declined)))
    return out


def _merged_rounds(h: Harness) -> dict[int, list[int]]:
    by_fragment: dict[int, list[int]] = {}
    for p in range(h.cfg.sync.num_fragments):
        for v in h.store.versions(p):
            meta = h.store.version_meta(p, v)
            if meta is not None and meta.round is not None:
                by_fragment.setdefault(p, []).append(meta.round)
    return by_fragment


def _play(store_dir: str, path: str) -> tuple:
    """The scenario decided by one path ("sensor": the quorum sensor's fallback with merge
    runs; "service": the syncer service in-process, its lease on the harness's clock)."""
    with dg.instance_for_test() as instance:
        h = Harness(instance, store_dir, overrides=[f"orchestration.syncer={path}", *JUMPS])
        h.start()
        if path == "service":
            service = SyncerService(h.store, attempt=0)
            service.lease.clock = lambda: h.now
            service.lease.acquire(4)
            _scenario(h, lambda: service.step(now=h.now))
        else:
            _scenario(h, lambda: h.tick(advance=0))
        assert h.store.stop_requested() is not None
        assert h.store.finished() is not None, path
        deciders = {h.store.get_decision(r).decided_by for r in range(4)}
        assert deciders == ({"sensor"} if path == "sensor" else {"syncer-a0"})
        if path == "sensor":
            # The decision table in Dagster has a row for every learner, and says why.
            table = h.merge_metadata(2)["decisions"].value.records
            status = {row.data["learner"]: row.data["status"] for row in table}
            assert status == {"learner-0": "merged", "learner-1": "declined",
                              "learner-2": "not live"}
        return _decided(h), _merged_rounds(h), h.store.list_contributions(0)


def test_the_syncer_service_and_the_sensor_fallback_decide_the_same_rounds(tmp_path):
    sensor = _play(str(tmp_path / "sensor"), "sensor")
    service = _play(str(tmp_path / "service"), "service")
    assert sensor == service
    decided, merged, offered_to_0 = service
    assert decided == EXPECTED
    assert merged == {0: [0, 2], 1: [1, 3]}          # every decided round merged exactly once
    assert offered_to_0 == NAMES                      # the late offer is kept, never merged


def test_pacing_holds_a_learner_tau_steps_past_an_offer_or_h_over_p_plus_tau_past_the_round():
    cfg = load_config(["sync.block_on_overlap=true", "sync.sync_period=16",
                       "sync.num_fragments=4", "sync.overlap_steps=2"])
    step_tokens = cfg.learner_step_tokens[0]
    # H/P + tau = 6 steps' worth of its own tokens past the newest round it saw open.
    assert not held_by_pacing(10, [], 5 * step_tokens, step_tokens, cfg)
    assert held_by_pacing(10, [], 6 * step_tokens, step_tokens, cfg)
    # tau = 2 steps past an offer whose merge has not come back.
    assert not held_by_pacing(10, [9], 0, step_tokens, cfg)
    assert held_by_pacing(11, [9], 0, step_tokens, cfg)
    # Off (the default, for the simulator and the real path alike): never held.
    off = load_config(["sync.sync_period=16", "sync.num_fragments=4", "sync.overlap_steps=2"])
    assert not off.sync.block_on_overlap
    assert not held_by_pacing(11, [9], 60 * step_tokens, step_tokens, off)


def test_the_old_pacing_key_names_where_it_moved():
    with pytest.raises(ConfigError, match="moved: it is sync.block_on_overlap"):
        load_config(["orchestration.block_on_overlap=true"])
