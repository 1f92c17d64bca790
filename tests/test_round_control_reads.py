"""The round controller's per-tick reads (issue 37): concurrent, in a fixed order, and one
learner's unreadable record refused with a reason while the tick goes on."""

import os
import threading
import time

import pytest
from learner_store_setup import committed_experiment

import pipelines.syncer.round_control as round_control
from pipelines.syncer.round_control import RoundController
from resources.store import layout
from resources.store.artifact_store import ArtifactStore
from resources.store.blobs import LocalBlobStore
from resources.store.fan_out import fan_out

M = 8
NAMES = [f"learner-{i}" for i in range(M)]


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return committed_experiment(str(tmp_path / "store"), "exp-reads", [
        "model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
        f"learners.num_learners={M}", "sync.num_fragments=2", "sync.min_quorum=2",
        "sync.max_speed_ratio=inf"])


def _beat(store: ArtifactStore, name: str, step: int, now: float) -> None:
    store.put_heartbeat(name, {"learner": name, "status": "training", "time": now,
                               "attempt": 0, "step": step, "tokens_total": 512 * step,
                               "compute_seconds": 0.01 * max(1, step),
                               "training_seconds": 1.0})


def _observing(monkeypatch) -> list:
    """What each tick handed the machine (`Observed`), in order."""
    seen = []
    real = round_control.step

    def spy(state, observed, *args, **kw):
        seen.append(observed)
        return real(state, observed, *args, **kw)
    monkeypatch.setattr(round_control, "step", spy)
    return seen


def _open_round_0(store: ArtifactStore, controller: RoundController, now: float) -> dict:
    for name in NAMES:
        _beat(store, name, 0, now)
    state = controller.tick(None, now=now).state
    for name in NAMES:
        _beat(store, name, 2, now + 1)
    state = controller.tick(state, now=now + 1).state
    assert state["round"] == 0, state
    return state


def _escape(store: ArtifactStore, key: str, tmp_path) -> None:
    """Replace `key` with a link to a file outside the store's root (what a learner that
    shares the machine can do to its own records)."""
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    path = store.blobs.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    path.symlink_to(outside)


def test_a_heartbeat_rewritten_between_two_ticks_is_seen(store, monkeypatch):
    seen = _observing(monkeypatch)
    controller, now = RoundController(store), time.time()
    state = _open_round_0(store, controller, now)
    _beat(store, "learner-3", 7, now + 2)
    controller.tick(state, now=now + 2)
    assert seen[-1].beats["learner-3"].step == 7
    assert [b.step for n, b in seen[-1].beats.items() if n != "learner-3"] == [2] * (M - 1)


def test_one_unreadable_heartbeat_is_refused_with_a_reason_and_the_tick_goes_on(
        store, monkeypatch, tmp_path):
    seen = _observing(monkeypatch)
    now = time.time()
    for name in NAMES:
        _beat(store, name, 0, now)
    _escape(store, layout.heartbeat(store.experiment, "learner-5"), tmp_path)
    result = RoundController(store).tick(None, now=now)
    observed = seen[-1]
    assert observed.beats["learner-5"] is None
    assert observed.refused_beats["learner-5"].startswith("unreadable: ValueError")
    assert "learner-5 (unreadable" in result.reason
    assert all(observed.beats[n] is not None for n in NAMES if n != "learner-5")


def test_a_heartbeat_that_is_a_fifo_does_not_hold_the_tick(store, tmp_path):
    now = time.time()
    for name in NAMES:
        _beat(store, name, 0, now)
    path = store.blobs.root / layout.heartbeat(store.experiment, "learner-2")
    path.unlink()
    os.mkfifo(path)
    done = []
    ticking = threading.Thread(target=lambda: done.append(
        RoundController(store).tick(None, now=now)), daemon=True)
    ticking.start()
    ticking.join(60)
    if ticking.is_alive():       # blocked opening the FIFO: let it go, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        ticking.join(10)
        pytest.fail("a FIFO in a learner's heartbeat's place held the tick")
    assert f"({M - 1} live)" in done[0].reason, done[0].reason     # all but learner-2


@pytest.mark.parametrize("describe_offers", [True, False], ids=["sensor", "syncer"])
def test_one_unreadable_offer_is_refused_with_a_reason_and_the_tick_goes_on(
        store, monkeypatch, tmp_path, describe_offers):
    seen = _observing(monkeypatch)
    controller = RoundController(store, describe_offers=describe_offers)
    now = time.time()
    state = _open_round_0(store, controller, now)
    directory = layout.contribution_dir(store.experiment, 0, "learner-6")
    _escape(store, f"{directory}/{layout.MANIFEST}", tmp_path)
    result = controller.tick(state, now=now + 2)
    offers = seen[-1].offers
    assert [(o.round, o.learner) for o in offers] == [(0, "learner-6")]
    assert offers[0].digest is None and offers[0].rejected.startswith("unreadable: ValueError")
    if describe_offers:              # the sensor reports it to Dagster, with the reason
        assert [o.learner for o in result.offers] == ["learner-6"]
        assert "unreadable" in result.offers[0].problem, result.offers[0]


class _SlowFirst(LocalBlobStore):
    """Heartbeats of lower-numbered learners take longer to read: concurrent reads end in
    the reverse of the order they were asked in."""

    read_concurrency = M

    def read(self, key):
        if key.endswith("heartbeat.json"):
            index = int(key.split("/")[-2].rsplit("-", 1)[1])
            time.sleep(0.02 * (M - index))
        return super().read(key)


def test_heartbeats_reach_the_machine_in_the_configs_order_whatever_order_reads_end(
        store, monkeypatch):
    seen = _observing(monkeypatch)
    slow = ArtifactStore(_SlowFirst(store.blobs.root), store.experiment)
    now = time.time()
    for name in NAMES:
        _beat(store, name, 0, now)
    RoundController(slow).tick(None, now=now)
    assert list(seen[-1].beats) == NAMES
    assert [b.learner for b in seen[-1].beats.values()] == NAMES


class _Meeting(LocalBlobStore):
    """Each heartbeat read waits until `parties` of them are in flight at once (a barrier):
    a tick that reads heartbeats one after another breaks it."""

    read_concurrency = 4

    def __init__(self, root, parties: int):
        super().__init__(root)
        self.barrier = threading.Barrier(parties, timeout=30)

    def read(self, key):
        if key.endswith("heartbeat.json"):
            self.barrier.wait()
        return super().read(key)


def test_a_ticks_heartbeat_reads_are_in_flight_together(store):
    meeting = ArtifactStore(_Meeting(store.blobs.root, parties=4), store.experiment)
    now = time.time()
    for name in NAMES:
        _beat(store, name, 0, now)
    result = RoundController(meeting).tick(None, now=now)
    assert f"({M} live)" in result.reason, result.reason


def test_fan_out_keeps_the_order_asked_bounds_the_reads_in_flight_and_raises():
    lock, flight, most = threading.Lock(), [0], [0]

    def read(i):
        with lock:
            flight[0] += 1
            most[0] = max(most[0], flight[0])
        time.sleep(0.001 * (20 - i))
        with lock:
            flight[0] -= 1
        return i * i

    assert fan_out(read, range(20), workers=3) == [i * i for i in range(20)]
    assert most[0] <= 3
    assert fan_out(read, [], workers=3) == []

    def fails(i):
        if i in (4, 7):
            raise KeyError(i)
        return i
    with pytest.raises(KeyError) as err:
        fan_out(fails, range(10), workers=4)
    assert err.value.args == (4,)        # the first in the order asked


def test_a_merge_passed_before_a_tick_saw_it_is_found_by_walking_back(store):
    """Two merges of one fragment published between two ticks: the machine sees only the
    later version, so the driver finds the version that merged each pending round (its
    members: whose offers vouch for tokens), or none for a round that was not merged."""
    from diloco_core.syncer_events import VersionSeen
    from diloco_core.syncer_machine import Pending

    current = store.load_global(0)
    for version, merged_round, members in ((1, 2, ["learner-0", "learner-1"]),
                                           (2, 6, ["learner-1"])):
        store.commit_global(0, version, current.params, current.outer_state,
                            {"round": merged_round, "members": members})
    controller = RoundController(store)
    pending = (Pending(2, 0, 1.0), Pending(4, 0, 2.0), Pending(6, 0, 3.0), Pending(3, 1, 4.0))
    passed = controller._passed(pending, {0: VersionSeen(6, ("learner-1",))})
    # Round 6 is the current version's own (seen directly); round 4 was not merged; fragment
    # 1 has not moved.
    assert passed == {2: ("learner-0", "learner-1"), 4: ()}



def test_a_rebuilt_accounts_clock_starts_no_earlier_than_one_round_timeout_ago(store):
    """A state rebuilt from the store starts each learner's account at the latest open
    record, timed from when that round opened, but never earlier than one round timeout
    before the rebuild: after a pause of days, a declared rate must not grant a liar the rate
    times the pause."""
    from diloco_core.round_records import RoundOpen
    from diloco_core.syncer_state_codec import state_from_json

    tokens = dict.fromkeys(NAMES, 4096)
    store.open_round(0, RoundOpen(round=0, fragment=0, opened_at=1000.0, learner_tokens=tokens))
    controller = RoundController(store)
    timeout = controller.cfg.orchestration.round_timeout_seconds
    soon = state_from_json(controller.tick(None, now=1010.0).state)
    assert soon.accounts.base == tokens
    assert set(soon.accounts.began.values()) == {1000.0}     # mid-round: from its opening
    later = state_from_json(RoundController(store).tick(None, now=1_000_000.0).state)
    assert set(later.accounts.began.values()) == {1_000_000.0 - timeout}
