"""The learner process loop against a real store: offers, receives, checkpoints, stops, and
rejoins from its own checkpoint or, when that is stale, from a peer's."""

import dataclasses
import os
import threading
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from learner_store_setup import collecting_logger
from orchestration_harness import Harness, wait_until

from diloco_core.budget_forecast import BudgetForecast
from diloco_core.round_records import Heartbeat
from resources.learner import store_link
from resources.learner.runtime import LearnerRuntime

pytestmark = pytest.mark.timeout(300)

# Blocking checkpoints: these tests run several learner runtimes as threads of one process. Two
# managers saving at once in one process used to hang or lose a save (a fresh-clone CI run hung
# in the stale-rejoin test; Orbax's process-wide operation ids, fixed in
# resources/store/checkpoints.py and tested in tests/test_checkpoints.py); blocking saves keep
# these tests as they were measured. The background path has its own test below and runs in
# every learner subprocess elsewhere.
# The paper's receive rule (the default until issue 38): these tests follow a learner that has
# nothing new to offer once a merge replaced its fragment; those about rebase set it.
FAST = ["sync.receive_rule=overwrite", "orchestration.async_checkpoints=false",
        "orchestration.checkpoint_every_steps=4", "orchestration.poll_seconds=0.05",
        "orchestration.heartbeat_seconds=0.2", "orchestration.learner_timeout_seconds=5",
        "orchestration.round_timeout_seconds=0.5", "orchestration.rejoin_max_versions_behind=1"]


@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), FAST)
        h.start()
        yield h


def _wait(predicate, timeout=60.0, what="condition"):
    wait_until(predicate, what, timeout)


def _start(h: Harness, learner: str, attempt: int = 0, max_steps: int = 8):
    runtime = LearnerRuntime(h.store, learner, attempt, max_steps=max_steps)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(runtime.run()), daemon=True)
    thread.start()
    return runtime, thread, result


def _offered_round_0(h: Harness):
    """learner-0 trains 8 steps and holds there (max_steps); round 0 (fragment 0) opens and
    it offers."""
    started = _start(h, "learner-0", max_steps=8)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 8,
          what="8 steps")
    h.store.open_round(0, {"fragment": 0, "opened_at": time.time(), "final": False})
    _wait(lambda: h.store.list_contributions(0) == ["learner-0"], what="the first offer")
    return started


def _bump(h: Harness, fragment: int, times: int, round_index: int | None = None) -> None:
    """Commit `times` new versions of a fragment (as merges of `round_index` would; None: a
    version whose round the learner cannot know, which it takes as merging its offer)."""
    for _ in range(times):
        g = h.store.load_global(fragment)
        params = {k: v + np.float32(0.001) for k, v in g.params.items()}
        h.store.commit_global(fragment, g.version + 1, params, g.outer_state,
                              {"round": round_index})


def test_a_learner_offers_receives_checkpoints_stops_and_resumes(harness):
    h = harness
    runtime, thread, result = _start(h, "learner-0")
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 8,
          what="8 steps")
    # Round 0 opens: the learner offers fragment 0 without being asked twice.
    h.store.open_round(0, {"fragment": 0, "opened_at": time.time(), "final": False})
    _wait(lambda: h.store.list_contributions(0) == ["learner-0"], what="an offer")
    offer = h.store.load_contribution(0, "learner-0")
    assert offer.fragment == 0 and offer.steps == 8 and offer.base_version == 0
    # A second, different offer to the same round (a relaunch re-offering) is refused by the
    # write-once store; it is dropped and does not block what comes after it.
    runtime.link.offer(dataclasses.replace(offer, steps=9), {})
    h.store.open_round(1, {"fragment": 1, "opened_at": time.time(), "final": False})
    _wait(lambda: h.store.list_contributions(1) == ["learner-0"], what="the next offer")
    assert h.store.load_contribution(0, "learner-0").steps == 8
    # A merged fragment 1 arrives: the learner takes it (its anchor and version move).
    _bump(h, 1, 1)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "versions", None) == (0, 1),
          what="the merged fragment")
    h.store.request_stop({"reason": "test"})
    thread.join(30)
    assert not thread.is_alive()
    assert result["status"] == "done" and result["offers"] == 2 and result["received"] == 1
    assert result["checkpoint_step"] == 8
    assert result["tokens_total"] == 8 * h.cfg.tokens_per_learner_step

    # Restart: its own checkpoint is fresh (versions within 1 of the global ones).
    again = LearnerRuntime(h.store, "learner-0", 1)
    source = again._start_state()
    assert source.startswith("own")
    assert int(again.train.step) == 8 and again.book.answered == 1
    assert [f.version for f in again.sync.fragments] == [0, 1]
    assert again.tokens_total == 8 * h.cfg.tokens_per_learner_step   # counted across attempts


def _hold_at_8_steps_with_fragment_1_merged(h: Harness):
    """learner-0 trains 8 steps and holds there (max_steps), then takes a merged fragment 1:
    it has nothing new on fragment 1 until it steps again."""
    started = _start(h, "learner-0", max_steps=8)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 8,
          what="8 steps")
    _bump(h, 1, 1)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "versions", None) == (0, 1),
          what="the merged fragment")
    return started


def test_a_round_opened_right_after_its_fragment_arrived_is_offered_after_the_next_step(
        harness):
    # The learner holds at step 8 (max_steps), takes a merged fragment 1, and only then sees a
    # round for fragment 1 open: nothing new to offer yet. It must not give the round up (if
    # every learner did, the round would get no offers and no later round would open).
    h = harness
    runtime, thread, result = _hold_at_8_steps_with_fragment_1_merged(h)
    h.store.open_round(1, {"fragment": 1, "opened_at": time.time(), "final": False})
    time.sleep(1.0)   # several loop iterations with the round open and nothing to offer
    assert h.store.list_contributions(1) == []
    runtime.max_steps = 10
    _wait(lambda: h.store.list_contributions(1) == ["learner-0"], what="the deferred offer")
    offer = h.store.load_contribution(1, "learner-0")
    assert offer.fragment == 1 and offer.base_version == 1 and 1 <= offer.steps <= 2
    h.store.request_stop({"reason": "test"})
    thread.join(30)
    assert result["status"] == "done"


def test_a_merge_that_arrives_with_the_round_it_opened_is_taken_before_the_offer(
        harness, monkeypatch):
    """A poll replaces the open round and queues the merges it found together. The loop reads
    the round before taking the merges, so a merge published before the round was seen open
    is in what it offers on. (Read the other way round, a poll landing between the two made
    the offer on the version before: the syncer refuses that as a replay of the learner's
    merged offer, and after STOP the round waited out its timeout for it; the chaos soak's
    tape 8 saw a final round do so.) Here the poll is made to land exactly there."""
    from resources.learner.store_link import StoreLink

    unpatched = StoreLink.open_round.fget

    def polled_on_read(link):
        if getattr(link, "poll_on_read", False):
            link.poll_on_read = False
            link._poll()                   # the background poll, at the worst moment
        return unpatched(link)

    monkeypatch.setattr(StoreLink, "open_round", property(polled_on_read))
    h = harness
    runtime, thread, result = _start(h, "learner-0", max_steps=8)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 8,
          what="8 steps")
    runtime.link.poll_seconds = 3600.0     # the link's own polls stop after the next one
    time.sleep(0.5)
    _bump(h, 0, 1)                         # a merge of fragment 0, then its round opens
    h.store.open_round(1, {"fragment": 0, "opened_at": time.time(), "final": False})
    runtime.link.poll_on_read = True
    time.sleep(0.5)
    runtime.max_steps = 10                 # news on fragment 0 after the merge, if it took it
    _wait(lambda: h.store.list_contributions(1) == ["learner-0"], what="the offer")
    assert h.store.load_contribution(1, "learner-0").base_version == 1
    h.store.request_stop({"reason": "test"})
    runtime.link.poll_on_read = True       # the link polls no more by itself: it sees STOP so
    thread.join(60)
    assert result["status"] == "done"


def test_a_relaunched_learner_keeps_its_earlier_attempts_offer_in_flight(tmp_path):
    """A learner never killed does not offer a fragment again until its last offer's merge
    arrives. A relaunched attempt starts with an empty book: it used to offer the fragment at
    once on the version the earlier offer was made on, which the syncer refuses as a replay
    once that merge is published (after STOP the round then waited for it). It inherits the
    earlier attempt's offer as in flight instead, and offers on the merged version."""
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    FAST + ["orchestration.round_timeout_seconds=5"])   # patience
        h.start()
        first, thread, _ = _offered_round_0(h)        # attempt 0: fragment 0 on version 0
        first.max_steps = 8
        again, thread_again, result = _start(h, "learner-0", attempt=1, max_steps=12)
        thread.join(30)                               # attempt 0 steps aside
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 12,
              what="attempt 1 training")
        h.store.open_round(2, {"fragment": 0, "opened_at": time.time(), "final": False})
        time.sleep(1.5)                               # round 0's merge is not published yet
        assert h.store.list_contributions(2) == []
        _bump(h, 0, 1, round_index=0)                 # it is: attempt 1 takes it and offers
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "versions", None) == (1, 0),
              what="round 0's merge")
        again.max_steps = 14
        _wait(lambda: h.store.list_contributions(2) == ["learner-0"], what="the offer")
        assert h.store.load_contribution(2, "learner-0").base_version == 1
        h.store.request_stop({"reason": "test"})
        thread_again.join(60)
        assert result["status"] == "done"


def test_a_final_round_with_nothing_new_is_declined_in_the_heartbeat(harness):
    # After STOP a learner trains no more: a final round for a fragment it just received can
    # never get an offer from it, so it says so (the syncer then stops waiting for it).
    h = harness
    runtime, thread, result = _hold_at_8_steps_with_fragment_1_merged(h)
    h.store.open_round(1, {"fragment": 1, "opened_at": time.time(), "final": True})
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "declined_rounds", None) == (1,),
          what="the declined final round")
    assert h.store.list_contributions(1) == []
    h.store.request_stop({"reason": "test"})
    thread.join(30)
    assert result["status"] == "done" and result["declined_rounds"] == [1]


def test_the_round_open_at_stop_is_declined_when_there_is_nothing_new(harness):
    # The round open when STOP comes was opened as an ordinary round. A learner that has
    # nothing new on its fragment and trains no more must answer it (decline): after STOP the
    # round waits for every live learner that did not decline, up to the round timeout.
    import dataclasses as dc

    from diloco_core.quorum import Estimates
    from diloco_core.round_protocol import decide_round

    h = harness
    runtime, thread, result = _hold_at_8_steps_with_fragment_1_merged(h)
    opened = time.time()
    h.store.open_round(1, {"fragment": 1, "opened_at": opened, "final": False})
    time.sleep(0.5)   # still training (held at max_steps): the round waits for its next step
    assert not getattr(h.store.get_heartbeat("learner-0"), "declined_rounds", None)
    h.store.request_stop({"reason": "test"})
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "declined_rounds", None) == (1,),
          what="the declined round open at STOP")
    assert h.store.list_contributions(1) == []
    # The syncer's rule then decides the round at once, not after the round timeout (300 s).
    cfg = dc.replace(h.cfg, orchestration=dc.replace(h.cfg.orchestration,
                                                     round_timeout_seconds=300.0))
    declined = h.store.get_heartbeat("learner-0").declined_rounds
    decision = decide_round(opened + 1, {}, ["learner-0"], Estimates(1.0), cfg, stopping=True,
                            opened_at=opened, declined=[n for n in ["learner-0"]
                                                        if 1 in declined])
    assert decision.merge and decision.members == () and "nothing new" in decision.reason
    thread.join(30)
    assert result["status"] == "done" and result["declined_rounds"] == [1]


def test_a_stale_learner_rejoins_from_a_peers_adamw_state_and_the_global_params(harness):
    h = harness
    # One after the other (two Orbax managers saving the same step at the same moment in one
    # process collide; real learners are separate processes). learner-1 starts from learner-0's
    # checkpoint (step 4: a first start takes a peer's AdamW state) and trains to step 8.
    started = []
    for name, steps in (("learner-0", 4), ("learner-1", 8)):
        started.append(_start(h, name, max_steps=steps))
        _wait(lambda n=name, s=steps: getattr(h.store.get_heartbeat(n), "checkpoint_step",
                                              None) == s, what=f"{name}'s checkpoint")
    # End both with the fencing path (a newer attempt appears), not STOP: at STOP both would
    # checkpoint at once, which two Orbax managers in one process do not survive reliably.
    for (_, thread, _), name in zip(started, ("learner-0", "learner-1"), strict=True):
        h.store.put_heartbeat(name, dataclasses.replace(h.store.get_heartbeat(name), attempt=1))
        thread.join(30)
        assert not thread.is_alive()
    _bump(h, 0, 3)                       # learner-0's fragment 0 is now 3 versions behind
    rejoined = LearnerRuntime(h.store, "learner-0", 2)
    source = rejoined._start_state()
    assert source.startswith("peer") and "learner-1 at step 8" in source
    assert int(rejoined.train.step) == 8                     # the peer's step and AdamW state
    g0 = h.store.load_global(0)
    name = next(iter(g0.params))
    np.testing.assert_array_equal(np.asarray(rejoined.train.params[name]), g0.params[name])
    assert [f.version for f in rejoined.sync.fragments] == [3, 0]
    assert rejoined.data.state()["position"] == 4             # its own data position


def test_an_orphaned_learner_steps_aside_when_a_newer_attempt_starts(harness):
    h = harness
    runtime, thread, result = _start(h, "learner-2", attempt=0, max_steps=1000)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-2"), "step", 0) >= 2,
          what="training")
    newer = dataclasses.replace(h.store.get_heartbeat("learner-2"), attempt=1,
                                pid=os.getpid() + 1)
    h.store.put_heartbeat("learner-2", newer)           # what attempt 1's first beat looks like
    thread.join(30)
    assert not thread.is_alive()
    assert result["status"] == "superseded"
    assert h.store.get_heartbeat("learner-2").attempt == 1     # never overwritten


def _at_the_first_barrier(instance, tmp_path):
    """learner-0 under tau = 0 pacing (synchronous DiLoCo's barrier), once it has trained its
    first H/P steps: (harness, H/P, runtime, thread)."""
    h = Harness(instance, str(tmp_path / "store"), FAST + [
        "sync.block_on_overlap=true", "sync.overlap_steps=0",
        "orchestration.round_timeout_seconds=5"])
    h.start()
    interval = h.cfg.sync.round_interval_steps
    runtime, thread, _ = _start(h, "learner-0", max_steps=10 * interval)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= interval,
          what="the first H/P steps")
    return h, interval, runtime, thread


def test_block_on_overlap_makes_a_barrier_at_every_sync(tmp_path):
    # The synchronous-DiLoCo baseline: tau = 0, the learner stops after each offer until the
    # merged fragment comes back, and stops at H/P steps when no round opens.
    with dg.instance_for_test() as instance:
        h, interval, runtime, thread = _at_the_first_barrier(instance, tmp_path)
        time.sleep(1.0)
        assert h.store.get_heartbeat("learner-0").step == interval   # no round: it waits
        h.store.open_round(0, {"fragment": 0, "opened_at": time.time()})
        _wait(lambda: h.store.contribution_manifest(0, "learner-0") is not None,
              what="the offer")
        time.sleep(1.0)
        assert h.store.get_heartbeat("learner-0").step == interval   # waits for the merge
        _bump(h, 0, 1)
        _wait(lambda: h.store.get_heartbeat("learner-0").step > interval,
              what="training to resume after the merged fragment arrived")
        assert runtime.ledger.superseded[0] == 0    # nothing computed between offer and merge
        h.store.request_stop({"reason": "test", "final_left": 0})
        thread.join(60)
        beat = h.store.get_heartbeat("learner-0")
        assert beat.training_seconds - beat.compute_seconds > 1.5  # the waits are idle


def test_a_round_that_opens_within_a_loop_iteration_is_offered_before_any_step(
        tmp_path, monkeypatch):
    # The link polls the store beside the loop: a round can open between the loop's check
    # for an offer and its pacing check. The first read that sees round 0 open is made to say
    # "no round" (as a read just before the poll would), every later read the round: a loop
    # that reads the link twice an iteration would end the barrier's wait "for a round" on
    # the second read and step once before offering (the race a CI run hit, 3 == 2).
    from resources.learner.store_link import StoreLink

    polled = StoreLink.open_round.fget
    hidden = {"done": False}

    def open_round(link):
        rnd = polled(link)
        if rnd is not None and not hidden["done"]:
            hidden["done"] = True
            return None
        return rnd

    monkeypatch.setattr(StoreLink, "open_round", property(open_round))
    with dg.instance_for_test() as instance:
        h, interval, runtime, thread = _at_the_first_barrier(instance, tmp_path)
        h.store.open_round(0, {"fragment": 0, "opened_at": time.time()})
        _wait(lambda: h.store.contribution_manifest(0, "learner-0") is not None,
              what="the offer")
        assert hidden["done"]
        manifest = h.store.contribution_manifest(0, "learner-0")
        assert manifest.learner_step == interval     # offered at the barrier, no step before
        h.store.request_stop({"reason": "test", "final_left": 0})
        thread.join(60)


def test_a_learner_started_from_a_peers_state_waits_on_its_own_tokens(tmp_path):
    # A learner that starts from a peer's checkpoint carries the peer's step counter but only
    # its own tokens. At the barrier it must have processed H/P steps' worth of its own tokens,
    # as the syncer counts them; counting steps stopped it short, and with K = M no round
    # ever opened (a deadlock seen in the chaos soak's synchronous run).
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), FAST + [
            "sync.block_on_overlap=true", "sync.overlap_steps=0",
            "orchestration.round_timeout_seconds=5", "orchestration.checkpoint_every_steps=1"])
        h.start()
        interval = h.cfg.sync.round_interval_steps
        _, first, _ = _start(h, "learner-1", max_steps=2 * interval)
        _wait(lambda: getattr(h.store.get_heartbeat("learner-1"), "checkpoint_step", None) or 0,
              what="learner-1's first checkpoint")
        runtime, thread, _ = _start(h, "learner-0", max_steps=10 * interval)
        step_tokens = h.cfg.learner_step_tokens[0]
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "tokens_total", 0)
              >= interval * step_tokens, what="H/P steps of learner-0's own tokens")
        time.sleep(1.0)
        beat = h.store.get_heartbeat("learner-0")
        assert beat.rejoined_from.startswith("peer"), beat.rejoined_from
        assert beat.tokens_total == interval * step_tokens      # no round: it waits here
        assert beat.step > interval                              # the peer's counter
        h.store.request_stop({"reason": "test", "final_left": 0})
        thread.join(60)
        first.join(60)


@pytest.mark.slow
def test_a_fragment_in_flight_is_not_offered_again_until_its_merge_arrives(tmp_path):
    # Counters run from the last receipt: a second offer of a fragment whose first offer has
    # not come back merged would count the first offer's tokens twice in the merge weights.
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    FAST + ["orchestration.round_timeout_seconds=20"])
        h.start()
        runtime, thread, result = _offered_round_0(h)
        runtime.max_steps = 12
        h.store.open_round(1, {"fragment": 1, "opened_at": time.time(), "final": False})
        _wait(lambda: h.store.list_contributions(1) == ["learner-0"], what="fragment 1's offer")
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 12,
              what="12 steps")
        h.store.open_round(2, {"fragment": 0, "opened_at": time.time(), "final": False})
        time.sleep(1.0)   # fragment 0's offer to round 0 is still in flight
        assert h.store.list_contributions(2) == []
        _bump(h, 0, 1)    # round 0's merge arrives: the learner takes it, then offers anew
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "versions", None) == (1, 0),
              what="round 0's merge")
        runtime.max_steps = 14
        _wait(lambda: h.store.list_contributions(2) == ["learner-0"], what="the later offer")
        offer = h.store.load_contribution(2, "learner-0")
        assert offer.base_version == 1 and 1 <= offer.steps <= 2
        # An offer that reaches its round after the round's merge (a late offer, whose
        # merged version the learner already holds) awaits nothing: the next round of that
        # fragment is offered at once, not after round_timeout_seconds.
        _bump(h, 0, 1, round_index=4)
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "versions", [0])[0] == 2,
              what="round 4's merge")
        h.store.open_round(4, {"fragment": 0, "opened_at": time.time(), "final": False})
        runtime.max_steps = 16
        _wait(lambda: h.store.list_contributions(4) == ["learner-0"], what="the late offer")
        runtime.max_steps = 18
        h.store.open_round(6, {"fragment": 0, "opened_at": time.time(), "final": False})
        _wait(lambda: h.store.list_contributions(6) == ["learner-0"], timeout=10,
              what="the next offer of the fragment")
        # After STOP it offers final rounds, none of which open here: it gives up after
        # round_timeout_seconds per fragment.
        h.store.request_stop({"reason": "test"})
        thread.join(120)
        assert result["status"] == "done"


@pytest.mark.slow
def test_a_newer_attempts_heartbeat_is_never_overwritten_by_an_older_process(tmp_path):
    """Real processes racing: attempts 0..3 of one learner each write heartbeats as fast as
    they can, each started while the previous one runs. Once an attempt's heartbeat is in the
    store, an older attempt's must never replace it (the write is conditional on what was
    read), and every older process steps aside.

    To reach the race every time, an attempt stalls between reading the heartbeat and writing
    its own once a newer one is starting (a zombie's pause), so the newer one's first heartbeat
    lands inside that window; and every process logs the generation of each heartbeat it
    stored, so the check is on the whole history of writes, in the order they landed, not on
    what a poller happened to see."""
    import json
    import subprocess
    import sys

    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store

    uri = str(tmp_path / "store")
    store = ArtifactStore(open_blob_store(uri), "race")
    racer = Path(__file__).with_name("heartbeat_racer.py")
    procs, newest, reverted = [], -1, []
    for attempt in range(4):
        if attempt:
            (tmp_path / f"slow-{attempt - 1}").touch()   # the older one is now a zombie
        procs.append(subprocess.Popen(
            [sys.executable, str(racer), uri, "race", str(attempt), "30",
             str(tmp_path / f"slow-{attempt}"), str(tmp_path / f"writes-{attempt}.log")],
            stdout=subprocess.PIPE, text=True))
        # Watch until this attempt's first heartbeat is in, then 1.5 s of racing.
        cap, until = time.monotonic() + 90, None
        while time.monotonic() < (until or cap):
            beat = store.get_heartbeat("learner-0")
            if beat is not None:
                if beat.attempt < newest:
                    reverted.append((newest, beat.attempt))
                newest = max(newest, beat.attempt)
                if until is None and newest == attempt:
                    until = time.monotonic() + (0 if attempt == 0 else 1.5)
    outcomes = [json.loads(p.communicate(timeout=60)[0]) for p in procs[:-1]]
    procs[-1].kill()
    procs[-1].wait()
    history = sorted(tuple(map(int, line.split())) for k in range(4)
                     for line in (tmp_path / f"writes-{k}.log").read_text().splitlines())
    generations = [g for g, _ in history]
    assert len(set(generations)) == len(generations), "two heartbeat writes share a generation"
    overwritten, newest_written = [], -1
    for _, a in history:
        if a < newest_written:
            overwritten.append((newest_written, a))
        newest_written = max(newest_written, a)
    assert newest == 3 and {a for _, a in history} == {0, 1, 2, 3}
    assert not overwritten, f"(newer, older) heartbeats overwritten: {overwritten[:5]}"
    assert not reverted, reverted[:5]
    assert all((o["superseded_by"] or -1) > k for k, o in enumerate(outcomes)), outcomes


def test_a_replaced_attempt_writes_no_offer(harness):
    """A zombie (attempt 0, still running after its learner was relaunched as attempt 1)
    must not offer: its progress would count twice when attempt 1 offers the same steps from
    its checkpoint. The link reads the heartbeat before each offer, not only at its own next
    heartbeat."""
    from resources.learner.store_link import StoreLink

    h = harness
    P = h.cfg.sync.num_fragments
    logs: list[str] = []
    log = collecting_logger("zombie-link", logs)
    zombie = StoreLink(h.store, "learner-0", P, [0] * P, 60.0, log, attempt=0)
    h.store.put_heartbeat("learner-0", {"learner": "learner-0", "status": "training",
                                        "time": h.now, "attempt": 1, "step": 0,
                                        "tokens_total": 0})      # the relaunched process
    zombie.offer(h.contribution("learner-0", 0), {"attempt": 0})
    zombie.close()
    assert h.store.contribution_manifest(0, "learner-0") is None
    assert zombie.superseded_by == 1
    assert any("dropped" in m and "replaced attempt 0" in m for m in logs), logs
    current = StoreLink(h.store, "learner-0", P, [0] * P, 60.0, log, attempt=1)
    current.offer(h.contribution("learner-0", 0), {"attempt": 1})
    current.close()
    assert h.store.contribution_manifest(0, "learner-0").extra["attempt"] == 1


def test_a_failed_poll_skips_no_merged_fragment(harness, monkeypatch):
    """A poll that fails after reading one fragment's new version (here: the next fragment's
    read raises) must deliver that version on a later poll, not take it as known."""
    from resources.learner.store_link import StoreLink

    h = harness
    P = h.cfg.sync.num_fragments
    _bump(h, 0, 1, round_index=0)
    _bump(h, 1, 1, round_index=1)
    link = StoreLink(h.store, "learner-0", P, [0] * P, 3600.0)
    link.close()                      # the thread polled once, before the failure was set
    link.take_merged()
    link._known = [0] * P
    real_load = h.store.load_global

    def flaky(fragment, *args, **kwargs):
        if fragment == 1:
            raise OSError("transient")
        return real_load(fragment, *args, **kwargs)

    monkeypatch.setattr(h.store, "load_global", flaky)
    link._poll()                      # fragment 0 read, fragment 1 failed: nothing taken
    assert link.take_merged() == {}
    monkeypatch.setattr(h.store, "load_global", real_load)
    link._poll()
    assert {p: a.version for p, a in link.take_merged().items()} == {0: 1, 1: 1}


def test_a_checkpoint_slower_than_the_learner_timeout_keeps_the_heartbeat_alive(tmp_path):
    # learner_timeout 1 s, a save that takes 2.5 s: without heartbeats during the save the
    # supervisor would take the learner for hung and end it in the middle of its checkpoint.
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    [*FAST, "orchestration.learner_timeout_seconds=1"])
        h.start()
        runtime = LearnerRuntime(h.store, "learner-0", 0, max_steps=4)
        real_save, saving = runtime.checkpoints.save, threading.Event()

        def slow_save(*args, **kwargs):
            saving.set()
            time.sleep(2.5)
            real_save(*args, **kwargs)
            saving.clear()

        runtime.checkpoints.save = slow_save
        thread = threading.Thread(target=runtime.run, daemon=True)
        thread.start()
        _wait(saving.is_set, what="the checkpoint at step 4")
        seen, gaps, last = set(), [], time.monotonic()
        while saving.is_set():
            beat = h.store.get_heartbeat("learner-0")
            if getattr(beat, "time", None) not in seen:
                seen.add(getattr(beat, "time", None))
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
                during = beat
            time.sleep(0.05)
        assert len(seen) >= 5, seen                  # a fresh heartbeat every ~0.2 s
        assert max(gaps[1:]) < 1.0, gaps             # never silent for a learner timeout
        assert during.status == "training" and during.step == 4
        h.store.request_stop({"reason": "test"})
        thread.join(30)
        assert not thread.is_alive() and runtime.progress.checkpoint_step == 4


@pytest.mark.parametrize("background", [True, False])
def test_a_background_checkpoint_lets_the_learner_train_on_and_is_reported_once_written(
        tmp_path, background):
    """The step-4 save is held in flight (Orbax says it is still writing) until the test lets
    it finish. In the background the learner trains on meanwhile and names no checkpoint it
    has not finished; blocking, it waits at step 4."""
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    [*FAST, f"orchestration.async_checkpoints={str(background).lower()}"])
        h.start()
        runtime = LearnerRuntime(h.store, "learner-0", 0, max_steps=12)
        manager = runtime.checkpoints.manager
        launched, release = threading.Event(), threading.Event()
        real_save, real_wait = manager.save, manager.wait_until_finished
        real_in_progress = manager.is_saving_in_progress

        def save(*args, **kwargs):   # Orbax's save first waits for the previous one
            result = real_save(*args, **kwargs)
            launched.set()
            return result

        def wait_until_finished():
            if launched.is_set():
                release.wait(120)
            real_wait()

        manager.save, manager.wait_until_finished = save, wait_until_finished
        manager.is_saving_in_progress = lambda: ((launched.is_set() and not release.is_set())
                                                 or real_in_progress())
        thread = threading.Thread(target=runtime.run, daemon=True)
        thread.start()
        beat = lambda: h.store.get_heartbeat("learner-0") or Heartbeat("none", 0.0)  # noqa: E731
        _wait(lambda: beat().step >= 4, what="the step-4 checkpoint")
        if background:
            _wait(lambda: beat().step >= 7, what="steps past the save in flight")
            assert beat().checkpoint_step is None
        else:
            time.sleep(1.0)   # ~20 steps' time: a blocking save holds the loop at step 4
            assert beat().step == 4 and beat().checkpoint_step is None
        release.set()
        _wait(lambda: beat().checkpoint_step is not None, what="a durable checkpoint")
        _wait(lambda: beat().step >= 12, what="12 steps")
        h.store.request_stop({"reason": "test"})
        thread.join(60)
        assert not thread.is_alive()
        final = h.store.get_heartbeat("learner-0")
        assert final.status == "done" and final.checkpoint_step == 12
        from resources.store.checkpoints import LearnerCheckpoints
        saved = LearnerCheckpoints(h.store.checkpoint_uri("learner-0"), read_only=True)
        assert saved.latest_step() == 12 and saved.restore()[1]["step"] == 12


def test_a_learner_whose_capacity_is_reclaimed_offers_what_it_has_and_leaves(tmp_path):
    # Leaving (`diloco capacity --leave`): it stops training, offers each fragment it has news
    # on to the rounds that come, exits with status "left", and its ledger has nothing
    # unoffered. A longer round timeout than FAST's: it bounds the leave (P timeouts).
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    [*FAST, "orchestration.round_timeout_seconds=6"])
        h.start()
        _leave(h)


def _leave(h: Harness) -> None:
    from pipelines.capacity_control import change_capacity
    from pipelines.token_ledger import run_ledger

    runtime, thread, result = _start(h, "learner-0", max_steps=None)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 4,
          what="4 steps")
    h.store.open_round(0, {"fragment": 0, "opened_at": time.time(), "final": False})
    _wait(lambda: h.store.list_contributions(0) == ["learner-0"], what="an offer")
    change_capacity(h.store, h.cfg, leave=["learner-0"], requested_by="test",
                    reason="spot VM reclaimed")
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "status", None) == "leaving",
          what="leaving")
    step = h.store.get_heartbeat("learner-0").step
    time.sleep(1.0)
    assert thread.is_alive()                                   # fragment 1 is not offered yet
    assert h.store.get_heartbeat("learner-0").step == step   # and it trains no more
    h.store.open_round(1, {"fragment": 1, "opened_at": time.time(), "final": False})
    _wait(lambda: h.store.list_contributions(1) == ["learner-0"], what="fragment 1's offer")
    assert h.store.load_contribution(1, "learner-0").steps == step
    # Fragment 0's news since round 0 goes to its next round (once round 0's offer is no
    # longer in flight: a round timeout after it, as no merge comes), then it exits.
    h.store.open_round(2, {"fragment": 0, "opened_at": time.time(), "final": False})
    thread.join(30)
    assert not thread.is_alive() and result["status"] == "left"
    assert h.store.get_heartbeat("learner-0").status == "left"
    offers = [h.store.load_contribution(r, "learner-0") for r in (0, 2)]
    assert offers[1].steps == step   # counters since its last receipt (it received nothing)
    ledger, _ = run_ledger(h.store, h.cfg)
    row = ledger.summary()["by_learner"]["learner-0"]
    assert row["left_before_offer"] == 0 and row["died_before_offer"] == 0
    assert ledger.balanced


@pytest.mark.parametrize("merged", [False, True], ids=["offer-not-merged", "offer-merged"])
def test_under_rebase_a_merge_without_the_learners_offer_keeps_its_progress(tmp_path, merged):
    """The learner offers fragment 0 to round 0; round 0's merge arrives without its offer (it
    was late, or not admitted) or with it. Without it, nothing it offered may be dropped: its
    parameters keep the offered progress on top of the merged values and its next offer
    carries those steps again, and its token ledger returns the claim (exact and balanced)."""
    from diloco_core.compression import decode
    from pipelines.token_ledger import run_ledger

    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), [*FAST, "sync.receive_rule=rebase",
                                                            "sync.encoding=fp32"])
        h.start()
        runtime, thread, result = _offered_round_0(h)
        offer = h.store.load_contribution(0, "learner-0")
        assert offer.steps == 8
        # Round 0 is decided and merged: a change of its own, with or without the offer.
        g = h.store.load_global(0)
        values = {k: v + np.float32(0.01) for k, v in g.params.items()}
        h.store.put_decision(0, {"round": 0, "fragment": 0,
                                 "members": ["learner-0"] if merged else [],
                                 "late": [] if merged else ["learner-0"], "reason": "test",
                                 "decided_at": time.time()})
        h.store.commit_global(0, 1, values, g.outer_state,
                              {"round": 0, "members": ["learner-0"] if merged else []})
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "versions", None) == (1, 0),
              what="the merged fragment")
        params = {k: np.asarray(runtime.train.params[k]) for k in values}
        for k, v in values.items():
            kept = v if merged else v - decode(offer.delta[k])   # theta = anchor - delta
            np.testing.assert_allclose(params[k], kept, rtol=0, atol=1e-6)
        # Two more steps, then round 2 (fragment 0): the offer carries 2 steps, or 10.
        runtime.max_steps = 10
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 10,
              what="10 steps")
        h.store.open_round(2, {"fragment": 0, "opened_at": time.time(), "final": False})
        _wait(lambda: h.store.list_contributions(2) == ["learner-0"], what="the next offer")
        again = h.store.load_contribution(2, "learner-0")
        assert (again.steps, again.base_version) == ((2 if merged else 10), 1)
        h.store.request_stop({"reason": "test"})
        thread.join(30)
        assert result["status"] == "done"
        record = h.store.attempt_records("learner-0")[-1]
        assert [tuple(c) for c in record["ledger"]["returned"]] == (
            [] if merged else [(0, 0, offer.tokens)])
        ledger, _ = run_ledger(h.store, h.cfg)
        assert ledger.balanced, ledger.problems
        assert not ledger.problems


def test_a_relaunch_into_a_round_its_refused_offer_sits_in_counts_the_round_answered(harness):
    """Offers are write-once: a learner relaunched into the round it already offered, whose
    manifest there the store refuses (a torn or foreign write), can never land another offer.
    It counts the round answered and starts, instead of failing at start-up on reading it."""
    from resources.store import layout

    h = harness
    h.store.open_round(0, {"fragment": 0, "opened_at": time.time(), "final": False})
    key = f"{layout.contribution_dir(h.store.experiment, 0, 'learner-0')}/{layout.MANIFEST}"
    h.store.blobs.write(key, b'{"fragment": "zero"}')
    again = LearnerRuntime(h.store, "learner-0", 1)
    again._start_state()
    assert again.book.answered == 0
    other = LearnerRuntime(h.store, "learner-1", 0)
    other._start_state()
    assert other.book.answered == -1            # a learner that did not offer still will


def _forecast(h: Harness, steps: int, at: float) -> None:
    """A budget forecast naming learner-0's target at `steps` steps (what the syncer writes)."""
    h.store.put_budget_forecast(BudgetForecast(
        budget=10**9, counted=0, at=at,
        targets={"learner-0": steps * h.cfg.tokens_per_learner_step}))


def _start_holding_at_2(h: Harness):
    """learner-0 started, and held at 2 steps (max_steps) until the test writes a forecast:
    one it found when it started would not count (a previous decider's, maybe)."""
    started = _start(h, "learner-0", max_steps=2)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 2, what="2 steps")
    time.sleep(0.3)     # a poll or two with no forecast
    return started


def _start_with_target(h: Harness, steps: int, max_steps: int):
    """learner-0 started, then given a forecast target at `steps` steps, then let train to
    `max_steps`."""
    runtime, thread, result = _start_holding_at_2(h)
    _forecast(h, steps, 1.0)
    runtime.max_steps = max_steps
    return runtime, thread, result


def _holds_at(h: Harness, steps: int, runtime) -> None:
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) == steps,
          what=f"a heartbeat at {steps} steps")
    time.sleep(1.0)
    assert int(runtime.train.step) == steps
    assert h.store.get_heartbeat("learner-0").step == steps


def test_a_learner_pauses_at_its_forecast_target_until_a_newer_forecast_or_stop(harness):
    """Issue 36: near the end of the budget a learner trains to its target in the syncer's
    forecast and no further (its heartbeat showing where it stopped) until the syncer says
    more: a newer forecast, or STOP. (Without the pause it trains on to max_steps.)"""
    h = harness
    runtime, thread, result = _start_with_target(h, 6, max_steps=40)
    _holds_at(h, 6, runtime)
    _forecast(h, 10, 2.0)
    _holds_at(h, 10, runtime)
    h.store.request_stop({"reason": "test", "final_left": 0})
    thread.join(30)
    assert not thread.is_alive() and result["status"] == "done" and result["step"] == 10


def test_a_forecast_no_newer_one_follows_pauses_a_learner_only_for_a_while(
        harness, monkeypatch):
    """A syncer that died after a forecast must not stall the run: past `PAUSE_SECONDS`
    without a newer forecast (or STOP) the learner trains on. Newer forecasts with the same
    target (a live syncer confirming it) keep it paused past that."""
    monkeypatch.setattr(store_link, "PAUSE_SECONDS", 1.5)
    h = harness
    runtime, thread, result = _start_with_target(h, 4, max_steps=12)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 4, what="4 steps")
    for i in range(8):       # 4 s of confirmations, every 0.5 s
        _forecast(h, 4, 2.0 + i)
        time.sleep(0.5)
    assert h.store.get_heartbeat("learner-0").step == 4
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) == 12,
          what="training on to max_steps once the forecast is old")
    h.store.request_stop({"reason": "test", "final_left": 0})
    thread.join(30)
    assert result["status"] == "done"


def test_a_malformed_forecast_never_pauses_a_learner(harness):
    h = harness
    h.store.blobs.write(f"experiments/{h.store.experiment}/FORECAST",
                        b'{"budget": 1, "counted": 0, "at": 0, "targets": {"learner-0": -1}}')
    runtime, thread, result = _start(h, "learner-0", max_steps=8)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) == 8, what="8 steps")
    h.store.request_stop({"reason": "test", "final_left": 0})
    thread.join(30)
    assert result["status"] == "done"


def test_a_learner_paused_at_its_target_steps_once_to_answer_a_round_of_a_fragment_it_received(
        harness):
    """Paused at its target, the learner takes a merged fragment 1, and a round for fragment
    1 opens: with no step since, it has nothing to offer, and before STOP a round waits for
    offers. It takes one step and offers (paused through it, the round, and the syncer's
    count of its tokens, waited until its pause ran out: the tiny demo at M = 1 stalled 28 s
    and then trained 11% past its budget), then pauses again."""
    h = harness
    runtime, thread, result = _start_with_target(h, 8, max_steps=40)
    _holds_at(h, 8, runtime)
    _bump(h, 1, 1)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "versions", None) == (0, 1),
          what="the merged fragment")
    for i in range(4):          # the syncer alive: the same target confirmed
        _forecast(h, 8, 2.0 + i)
    h.store.open_round(1, {"fragment": 1, "opened_at": time.time(), "final": False})
    # (well inside the 60 s pause: paused through the round, it offers only once that ends)
    _wait(lambda: h.store.list_contributions(1) == ["learner-0"], what="the offer", timeout=10)
    assert h.store.load_contribution(1, "learner-0").steps == 1
    _holds_at(h, 9, runtime)
    h.store.request_stop({"reason": "test", "final_left": 0})
    thread.join(30)
    assert result["status"] == "done" and result["step"] == 9


def test_a_forecast_found_when_the_learner_starts_counts_only_once_a_newer_one_comes(harness):
    """A run interrupted and resumed (or its budget raised) leaves the last decider's forecast
    in the store: a learner that starts finds it, and does not pause at it (it would have
    for up to PAUSE_SECONDS, behind targets of a budget no longer in force); a newer one, as
    a live decider writes every few seconds near the end, counts."""
    h = harness
    _forecast(h, 4, 1.0)
    runtime, thread, result = _start(h, "learner-0", max_steps=10)
    _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) == 10,
          what="10 steps, past the old forecast's target")
    _forecast(h, 14, 2.0)
    runtime.max_steps = 40
    _holds_at(h, 14, runtime)
    h.store.request_stop({"reason": "test", "final_left": 0})
    thread.join(30)
    assert result["status"] == "done" and result["step"] == 14


def test_a_learner_beats_as_soon_as_it_is_ready_for_the_next_round(tmp_path):
    # The syncer opens a round when K learners' heartbeats show H/P steps' tokens since the
    # latest round opened. With only the periodic beat (here every 120 s) a ready learner was
    # seen up to an interval late and every round opened that much later (the demo merged 52
    # rounds where its calibrated simulator merged 66). The learner beats on the step it
    # becomes ready, before round 0 and after each round opens, and only once a round.
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"),
                    FAST + ["orchestration.heartbeat_seconds=120",
                            "orchestration.learner_timeout_seconds=300"])
        h.start()
        interval = h.cfg.sync.round_interval_steps
        step_tokens = h.cfg.learner_step_tokens[0]
        last = 3 * interval * step_tokens      # its tokens once held at max_steps

        def beat_tokens() -> int:
            return getattr(h.store.get_heartbeat("learner-0"), "tokens_total", 0)

        runtime, thread, _ = _start(h, "learner-0", max_steps=3 * interval)
        _wait(lambda: beat_tokens() >= interval * step_tokens, timeout=60,
              what="the beat ready for round 0")
        _wait(lambda: int(runtime.train.step) >= 3 * interval, what="its last step")
        time.sleep(1.0)
        assert beat_tokens() == interval * step_tokens        # once, on the step it was ready
        # Round 0 opened with the learner further on than it is: not ready, no beat.
        h.store.open_round(0, {"fragment": 0, "opened_at": time.time(),
                               "learner_tokens": {"learner-0": last + step_tokens}})
        time.sleep(1.0)
        assert beat_tokens() == interval * step_tokens
        # Round 1 opened with it H/P steps behind where it is: ready at once.
        h.store.open_round(1, {"fragment": 1, "opened_at": time.time(),
                               "learner_tokens": {"learner-0": last - interval * step_tokens}})
        _wait(lambda: beat_tokens() == last, timeout=30, what="the beat ready for round 2")
        h.store.request_stop({"reason": "test", "final_left": 0})
        thread.join(60)
