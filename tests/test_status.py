"""`diloco status`: the rounds, each learner's state (live, late, rejoining, down, done) and the
last decisions, read from the store of a run driven through the real quorum sensor and merges."""

import contextlib
import dataclasses
import io
import json

import dagster as dg
import pytest
from orchestration_harness import Harness
from rich.console import Console

from diloco_core.round_records import Heartbeat
from pipelines.commands.cli import main
from pipelines.commands.status import learner_state, print_status, run_status


@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"))   # 3 learners, K=2, no grace
        h.start()
        yield h


def _merge_round(h: Harness, r: int, offering, beating) -> None:
    for name in beating:
        h.beat(name, 2)
    h.tick()
    for name in offering:
        h.offer(name, r)
    h.tick()


def test_status_shows_rounds_learner_states_and_decisions(harness):
    h = harness
    everyone = ["learner-0", "learner-1", "learner-2"]
    _merge_round(h, 0, ["learner-0", "learner-1"], everyone)   # learner-2 live, not offering
    status = run_status(h.store, now=h.now)
    assert status.rounds_merged == 1 and status.global_versions == [1, 0]
    states = {row.learner: row.state for row in status.learners}
    assert states == {"learner-0": "live", "learner-1": "live", "learner-2": "late"}
    (decision,) = status.decisions
    assert list(decision.members) == ["learner-0", "learner-1"]
    assert list(decision.missing) == ["learner-2"] and decision.reason

    # learner-1 is relaunched (attempt 1, started now): rejoining until a merge admits it.
    beat = dataclasses.replace(h.store.get_heartbeat("learner-1"), attempt=1,
                               started_at=h.now + 0.5)
    h.store.put_heartbeat("learner-1", beat)
    assert {r.learner: r.state for r in run_status(h.store, now=h.now).learners}[
        "learner-1"] == "rejoining"
    h.now += 1.0
    _merge_round(h, 1, ["learner-1", "learner-2"], ["learner-0", "learner-2"])
    h.store.put_heartbeat("learner-1", dataclasses.replace(beat, time=h.now))
    states = {r.learner: r.state for r in run_status(h.store, now=h.now).learners}
    assert states["learner-1"] == "live" and states["learner-2"] == "live"

    # The same as a table, and from the CLI as JSON. (Not capsys: the Dagster runs above keep
    # a handle on the stream it replaces.)
    table = io.StringIO()
    print_status(run_status(h.store, now=h.now), Console(file=table, width=200))
    assert "exp-test: 2 rounds merged" in table.getvalue() and "rejoining" not in table.getvalue()
    # No syncer service here (orchestration.syncer=sensor): the sensor decided the last round.
    syncer = run_status(h.store, now=h.now).syncer
    assert syncer.state == "sensor"
    assert syncer.last_decision.round == 1
    assert syncer.last_decision.decided_by == "sensor"
    assert "the quorum sensor decides" in table.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--store", h.resource.base_uri, "--json", "--rounds", "1"]) == 0
    shown = json.loads(out.getvalue())
    assert [d["round"] for d in shown["decisions"]] == [1]


def with_status(beat: Heartbeat, status: str) -> Heartbeat:
    return dataclasses.replace(beat, status=status)


def test_down_done_and_not_started_learners(harness):
    timeout = harness.cfg.orchestration.learner_timeout_seconds
    beat = Heartbeat("training", 100.0, attempt=0, started_at=0.0)
    assert learner_state(None, [], "a", timeout, 100.0) == "not started"
    assert learner_state(beat, [], "a", timeout, 100.0 + timeout + 1) == "down"
    assert learner_state(with_status(beat, "failed"), [], "a", timeout, 100.0) == "down"
    assert learner_state(with_status(beat, "done"), [], "a", timeout, 1e9) == "done"
    assert learner_state(beat, [], "a", timeout, 101.0) == "live"


def test_status_without_an_experiment_says_what_to_do(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["status", "--store", str(tmp_path / "empty")]) == 2
    assert "no active experiment" in capsys.readouterr().err


def test_capacity_shows_in_a_learners_state():
    from pipelines.commands.status import learner_state

    beat = Heartbeat("training", 100.0, attempt=0)
    assert learner_state(None, [], "a", 15.0, 100.0, absent=True) == "standby"
    assert learner_state(beat, [], "a", 15.0, 100.0, absent=True) == "leaving"
    assert learner_state(with_status(beat, "left"), [], "a", 15.0, 1e9, absent=True) == "left"
    assert learner_state(with_status(beat, "left"), [], "a", 15.0, 1e9) == "joining"


def test_status_shows_who_holds_the_syncers_lease_since_when_and_its_renewal(tmp_path):
    """The syncer's line: none yet, the syncer (attempt 0), its warm standby after the syncer
    died holding the lease, silent once the lease has not moved for the syncer timeout,
    released on a clean exit; read from the lease record a real `SyncerLease` writes."""
    import os

    from resources.store.lease import SyncerLease

    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), ["orchestration.syncer=service"])
        h.start()
        assert run_status(h.store).syncer.state == "none"

        syncer = SyncerLease(h.store, 0, name="syncer-a0")
        syncer.acquire(stale_after=20.0)
        row = run_status(h.store).syncer
        assert (row.state, row.holder, row.attempt, row.standby) == (
            "syncing", "syncer-a0", 0, False)
        assert row.renewed_age_s < 60 and row.held_for_s < 60

        # The syncer's process "died" holding the lease (its pid on this host is named dead,
        # as the standby does when its pipe from the syncer closes): the standby takes it.
        standby = SyncerLease(h.store, 0, name="syncer-a0-standby")
        standby.acquire(stale_after=600.0, dead_pid=os.getpid())
        row = run_status(h.store).syncer
        assert (row.state, row.holder, row.attempt, row.standby, row.epoch) == (
            "syncing", "syncer-a0-standby", 0, True, 2)
        since = row.since
        table = io.StringIO()
        print_status(run_status(h.store), Console(file=table, width=250))
        assert "syncer-a0-standby (attempt 0, the warm standby) has held the lease since" in \
            table.getvalue()

        standby.renew(force=True)         # a renewal moves the renewal time, not `since`
        assert run_status(h.store).syncer.since == since

        later = since + h.cfg.orchestration.syncer_timeout_seconds + 30
        row = run_status(h.store, now=later).syncer
        assert row.state == "silent" and row.renewed_age_s >= 30
        table = io.StringIO()
        print_status(run_status(h.store, now=later), Console(file=table, width=250))
        assert "dead or hung" in table.getvalue()

        standby.release()
        assert run_status(h.store).syncer.state == "released"


def test_status_reads_only_the_decisions_it_shows_however_long_the_run(tmp_path):
    """A month-long run has millions of rounds: `diloco status` reads the last few decisions,
    and for a relaunched learner only back to the decision that admitted it since its start
    (or to its start); every decision before that goes unread. Its answers are those of a
    reading of every decision."""
    from diloco_core.config_loading import config_from_mapping, config_to_mapping
    from diloco_core.round_records import RoundDecision, RoundOpen
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store

    cfg = config_from_mapping({}, ["name=long", "learners.num_learners=3"])
    store = ArtifactStore(open_blob_store(str(tmp_path / "store")), "long")
    store.put_config(config_to_mapping(cfg))
    rounds, now = 300, 10_000.0
    for r in range(rounds):
        # learner-2 is admitted last in round 249; round 250 is decided after its relaunch.
        members = ("learner-0", "learner-1", "learner-2") if r < 250 else ("learner-0",
                                                                              "learner-1")
        store.put_decision(r, RoundDecision(r, r % 2, members, "quorum", decided_at=float(r)))
    store.open_round(rounds, RoundOpen(rounds, rounds % 2, opened_at=float(rounds)))
    for n, attempt, started in (("learner-0", 0, 0.0), ("learner-1", 1, 120.5),
                                ("learner-2", 1, 249.5)):
        store.put_heartbeat(n, {"learner": n, "status": "training", "time": now,
                                "attempt": attempt, "started_at": started, "step": 1})
    reads = []
    get_decision = store.get_decision
    store.get_decision = lambda r: reads.append(r) or get_decision(r)

    status = run_status(store, now=now, last_rounds=5)
    states = {row.learner: row.state for row in status.learners}
    # learner-1 (relaunched at 120.5) is in the newest decision; learner-2 (relaunched at
    # 249.5) has not been admitted since: reading stops at round 249, decided before its start.
    assert states == {"learner-0": "live", "learner-1": "live", "learner-2": "rejoining"}
    assert [d.round for d in status.decisions] == [295, 296, 297, 298, 299]
    assert sorted(reads) == list(range(249, rounds + 1))   # not 0-248
    assert status.rounds_merged == 0      # versions: none committed in this store
