"""Chaos: one run of real learner processes under a fault tape with every learner-, store-,
contribution- and merge-level fault, then one test per fault kind against what the run left in
the store. (Dagster daemon, webserver and instance restarts: `test_dagster_restarts.py` and the
soak benchmark.)
"""

import json
import math

import dagster as dg
import numpy as np
import pytest
from chaos_harness import ChaosRun
from orchestration_harness import Harness

from diloco_core.fault_tape import tape_from_mapping
from diloco_core.stored_merge import StoredMerge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEARNERS = ["learner-0", "learner-1", "learner-2"]
# The paper's receive rule (the default until issue 38): the ledger test counts a refused
# offer's tokens as rejected, which under rebase stay in the learner and reach a later merge.
CHAOS = ["sync.receive_rule=overwrite",
         "learners.speeds=[1.0, 1.0, 1.0]", "sync.sync_period=40", "sync.grace_gamma=0.5",
         # The budget covers the tape's last fault (round 11) with rounds to spare: before
         # learners paused at the budget forecast, the overshoot stretched 135,000 tokens over
         # 12+ rounds; trained to the budget, they made 9.
         "sync.grace_min_seconds=1.0", "token_budget=200000",
         "orchestration.step_seconds_floor=0.1", "orchestration.checkpoint_every_steps=10",
         "orchestration.heartbeat_seconds=0.5", "orchestration.poll_seconds=0.25",
         "orchestration.learner_timeout_seconds=8", "orchestration.round_timeout_seconds=20",
         "name=chaos"]
# The hang comes early enough (50 steps after the killed learner's restore from step 60) that
# after it is detected (8 s), relaunched and recompiled there is still a good part of the budget
# left for it to be merged again, on a slow, loaded machine too.
KILL_STEP, HANG_STEP = 65, 110
# A slow stretch once the run is warm (the first merges compile, seconds apart), long enough
# that two of its offers fall inside (offers come every 20-30 of its steps).
SLOW_AT, SLOW_STEPS = 180, 80
BAD = {3: ("learner-0", "nan"), 5: ("learner-2", "truncated"), 7: ("learner-0", "absurd"),
       9: ("learner-2", "pickle"), 11: ("learner-0", "wrong_shape")}
CRASH = {2: "before_commit", 4: "during_commit", 6: "after_commit"}
TAPE = {"seed": 5, "faults": [
    {"id": "kill-1", "kind": "learner_kill", "learner": "learner-1", "at_step": KILL_STEP},
    {"id": "hang-1", "kind": "learner_hang", "learner": "learner-1", "at_step": HANG_STEP},
    {"id": "slow-2", "kind": "learner_slow", "learner": "learner-2", "at_step": SLOW_AT,
     "params": {"factor": 3.0, "steps": SLOW_STEPS}},
    {"id": "skew-0", "kind": "clock_skew", "learner": "learner-0", "at_step": 0,
     "params": {"seconds": -3600}},
    {"id": "store-2", "kind": "store_errors", "learner": "learner-2", "at_step": 80,
     "params": {"rate": 0.3, "steps": 60, "slow_seconds": 0.2}},
    *({"id": f"bad-{r}", "kind": "bad_contribution", "learner": who, "at_round": r,
       "params": {"mode": mode}} for r, (who, mode) in BAD.items()),
    *({"id": f"crash-{r}", "kind": "merge_crash", "at_round": r, "params": {"phase": phase}}
      for r, phase in CRASH.items()),
    {"id": "merge-store-8", "kind": "merge_store_errors", "at_round": 8,
     "params": {"rate": 0.5}},
]}


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos")
    tape_path = tmp / "tape.json"
    tape_path.write_text(json.dumps(TAPE))
    store_uri = str(tmp / "store")
    with dg.instance_for_test() as instance:
        h = Harness(instance, store_uri, CHAOS)
        h.start(str(tape_path))
        run = ChaosRun(h, store_uri, tmp)
        summary = run.run()
        fired = {f["id"]: f for f in h.store.fired_faults()}
        yield {"summary": summary, "store": h.store, "run": run, "fired": fired, "h": h}


def _merges(summary):
    return [r for r in summary["rounds"] if r["merged"]]


def _back_within(summary, learner, after, bound=6):
    """Rounds merged after `after` until `learner` is merged again."""
    later = [r for r in _merges(summary) if r["published_at"] > after]
    for i, r in enumerate(later):
        if learner in r["admitted"] and learner not in r["rejected"]:
            assert i <= bound, [x["admitted"] for x in later[:i + 1]]
            return i
    raise AssertionError(f"{learner} never merged again after {after}")


def test_the_tape_is_validated_and_every_fault_fired(chaos):
    tape = tape_from_mapping(TAPE, LEARNERS)
    assert set(chaos["fired"]) == {f.id for f in tape.faults}, sorted(chaos["fired"])


def test_a_killed_learner_rejoins_and_merges_never_stop(chaos):
    s, store = chaos["summary"], chaos["store"]
    kill = chaos["fired"]["kill-1"]
    first = store.attempt_records("learner-1")[0]
    assert first["status"] == "killed" and first["final"] and first["step"] == KILL_STEP
    # It was merged again within a bounded number of rounds ...
    _back_within(s, "learner-1", kill["time"])
    rejoin = next(r for r in s["rejoins"] if r["fault"] == "kill-1")
    assert rejoin["rejoin_seconds"] > 0 and rejoin["rounds_missed"] <= 6
    # ... and merges went on without it meanwhile (zero global downtime): every round merged
    # between the kill and its return. (Whether one was is a race: the kill comes while the
    # first merges still compile, 12-18 s apart on a loaded 2-core machine, and a relaunch can
    # be back before the next one; a fresh-clone CI run saw none in between. The soaks measure
    # downtime over whole runs.)
    back = next(r for r in _merges(s) if r["round"] == rejoin["back_in_round"])
    between = [r for r in _merges(s) if kill["time"] < r["published_at"] < back["published_at"]]
    assert len(between) == rejoin["rounds_missed"]
    # ... and none waited for it: a merge of that window admits it only through an offer it
    # made before it was killed, to a round opened before the kill (whether the relaunched
    # learner is back before a round opened after the kill is merged is a race; CI lost it).
    for r in between:
        if "learner-1" in r["admitted"]:
            assert store.get_round_open(r["round"]).opened_at < kill["time"], r


def test_a_hung_learner_is_ended_relaunched_and_rejoins(chaos):
    store, run = chaos["store"], chaos["run"]
    hang = chaos["fired"]["hang-1"]
    ended = [e for e in run.events if e["event"] == "terminated" and e["learner"] == "learner-1"]
    assert ended and ended[0]["attempt"] == hang["attempt"]
    record = next(a for a in store.attempt_records("learner-1")
                  if a["attempt"] == hang["attempt"])
    assert record["status"] == "failed" and record["final"]   # interrupted, ledger written
    _back_within(chaos["summary"], "learner-1", ended[0]["at"])


def test_a_slowed_learner_only_costs_its_own_contribution(chaos):
    s = chaos["summary"]
    slow = chaos["fired"]["slow-2"]
    # The global model kept advancing through the slow window (merges every few seconds).
    during = [r for r in _merges(s) if slow["time"] < r["published_at"] < slow["time"] + 12]
    assert len(during) >= 2
    # Its own steps were 3x slower inside the window (offers carry its step and clock).
    store = chaos["store"]
    offers = sorted((m.learner_step, m.clock) for r in range(len(s["rounds"]) + 2)
                    if (m := store.contribution_manifest(r, "learner-2")) is not None)

    def rate(*spans):
        # Consecutive offers with steps between them (final-round offers after STOP repeat
        # the same step: no pace to measure there).
        inside = [(a, b) for a, b in zip(offers, offers[1:], strict=False)
                  if b[0] > a[0] and any(lo <= a[0] and b[0] <= hi for lo, hi in spans)]
        assert inside, f"no two offers within steps {spans}: {offers}"
        return (sum(b[0] - a[0] for a, b in inside)
                / sum(b[1] - a[1] for a, b in inside))

    # Its normal pace: before the store errors (steps 80-140, which slow it too), between them
    # and the slow window, and after the window. Only after the window was too little on a
    # machine where it reached the budget some 30 steps past it (a fresh-clone CI run), and
    # steps 140-180 may hold no two offers.
    normal = rate((0, 80), (140, SLOW_AT), (SLOW_AT + SLOW_STEPS, 10**6))
    assert rate((SLOW_AT, SLOW_AT + SLOW_STEPS)) < 0.6 * normal


def test_store_errors_are_retried_and_nothing_is_lost(chaos):
    s, run = chaos["summary"], chaos["run"]
    fault = chaos["fired"]["store-2"]
    log = run.log("learner-2", fault["attempt"])
    assert "injected" in log and "will retry" in log
    _back_within(s, "learner-2", fault["time"] + 6 * 0.2, bound=8)
    assert s["ledger"]["balanced"], s["ledger"]["problems"]


@pytest.mark.parametrize("round_index", sorted(BAD))
def test_bad_contributions_are_rejected_with_a_reason(chaos, round_index):
    s = chaos["summary"]
    learner, mode = BAD[round_index]
    fault = chaos["fired"][f"bad-{round_index}"]
    round_index = fault["round"]   # the learner's first offer at or after the tape's round
    rnd = next(r for r in s["rounds"] if r["round"] == round_index)
    if learner not in rnd["admitted"]:
        # Not admitted: late within the decision (listed), or offered after the round was
        # decided (a learner can be that slow on a loaded machine; listed nowhere). Either
        # way the merge never loaded it, so it cannot reach the model.
        store, p = chaos["store"], rnd["fragment"]
        found = store.find_round_commit(p, round_index, store.current_version(p),
                                        store.version_meta(p) or StoredMerge())
        assert found is None or learner not in found[1].members, (rnd, found)
        return
    expected = {"nan": ["NaN"], "truncated": ["refused by the store"],
                "absurd": ["norm per step"], "wrong_shape": ["has shape"],
                # The pickle fault rewrites the manifest after the offer is committed: a decision
                # taken between the two admitted the original, and the merge then refuses the
                # rewrite before it reads the payload.
                "pickle": ["not a plain array bundle", "changed after the decision"]}[mode]
    assert any(e in rnd["rejected"][learner] for e in expected), rnd["rejected"]
    assert fault["learner"] == learner
    rejections = [x for x in s["ledger"]["rejections"] if x["round"] == round_index]
    assert [x["learner"] for x in rejections] == [learner]


def test_bad_contributions_never_reach_the_model(chaos):
    store = chaos["store"]
    for p in range(2):
        params = store.load_global(p).params
        assert all(np.isfinite(v).all() and np.abs(v).max() < 100 for v in params.values())
    s = chaos["summary"]
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.3


def test_merge_crashes_lose_no_round_and_apply_none_twice(chaos):
    s, store = chaos["summary"], chaos["store"]
    for r, phase in CRASH.items():
        assert chaos["fired"][f"crash-{r}"]["phase"] == phase
    assert chaos["fired"]["merge-store-8"]["round"] == 8
    committed = []
    for p in range(2):
        versions = store.versions(p)
        assert versions == list(range(len(versions)))           # contiguous, none orphaned
        rounds = [store.version_meta(p, v).round for v in versions[1:]]
        assert rounds == sorted(set(rounds))                    # each round at most once
        committed += rounds
    for r in s["rounds"]:
        if r["admitted"] and set(r["admitted"]) - set(r["rejected"]):
            assert r["round"] in committed, r                   # no decided round lost
    for r in list(CRASH) + [8]:
        assert r in committed


def test_a_skewed_clock_does_not_make_a_learner_look_dead(chaos):
    store = chaos["store"]
    beat = store.get_heartbeat("learner-0")
    assert beat.time < (beat.started_at or 0) - 3000      # its clock is an hour behind
    skew = chaos["fired"]["skew-0"]
    merged = [r for r in _merges(chaos["summary"]) if r["published_at"] > skew["time"]]
    assert sum("learner-0" in r["admitted"] for r in merged) >= len(merged) // 3


def test_the_token_ledger_balances_exactly(chaos):
    ledger = chaos["summary"]["ledger"]
    assert ledger["balanced"], ledger["problems"]
    assert ledger["exact"], ledger["inexact_attempts"]
    tokens = ledger["tokens"]
    assert math.isclose(sum(tokens.values()), ledger["tokens_processed"])
    # Most work reaches the model even under this tape; the exact share depends on how fast
    # merges run against the learners' steps (machine load), so the bound is loose.
    assert tokens["merged"] > 0.3 * ledger["tokens_processed"]
    assert tokens["rejected"] > 0                       # the bad contributions
    assert tokens["died_before_offer"] > 0              # the killed and the hung process
    one = ledger["by_learner"]["learner-1"]
    assert math.isclose(sum(v for k, v in one.items() if k != "processed"), one["processed"])
