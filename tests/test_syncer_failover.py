"""Syncer failover: a syncer process that dies holding its lease is replaced by its warm
standby at once, not after the lease goes stale and a relaunch warms up; at most one syncer
ever commits (the lease, fenced writes), and a syncer that ends cleanly is never taken over.

Scripted learners (tests/orchestration_harness.py) write heartbeats and offers; the syncers are
real processes (`python -m pipelines.syncer.entry`), each with its standby child.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from orchestration_harness import Harness, wait_until

from pipelines.commands.status import run_status
from resources.store.lease import LeaseLost, LeaseRefused, SyncerLease

NAMES = ["learner-0", "learner-1", "learner-2"]
# A long stale timeout: a takeover within it can only be the standby's (nothing else here
# relaunches a syncer or decides rounds).
SERVICE = ["orchestration.syncer=service", "orchestration.syncer_timeout_seconds=600"]


class _Clock:
    """A scripted clock; while `holder` is set, the holder renews whenever the other side
    sleeps (a live holder)."""

    def __init__(self):
        self.now, self.holder = 0.0, None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.holder is not None:
            self.holder.renew(force=True)


def test_a_holder_known_dead_is_taken_over_at_once_and_nothing_else_is(tmp_path):
    """`dead_pid` names the holder's process on this host as ended: its lease is taken at once.
    A same-attempt holder with another pid still counts as live while it renews (refused),
    and a newer attempt's lease is never taken, dead or not."""
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store

    store = ArtifactStore(open_blob_store(str(tmp_path / "store")), "exp")
    clock = _Clock()

    def lease(attempt: int) -> SyncerLease:
        return SyncerLease(store, attempt, clock=clock, sleep=clock.sleep)

    holder = lease(0)
    holder.acquire(10)
    standby = lease(0)
    clock.holder = holder
    with pytest.raises(LeaseRefused):        # another pid named dead: the holder is live
        standby.acquire(10, dead_pid=os.getpid() + 1)
    clock.holder = None
    started = clock.now
    taken = standby.acquire(10, dead_pid=os.getpid())    # the holder's pid (this process)
    assert clock.now == started, "waited for a holder known to be dead"
    assert taken.record.epoch == 2 and taken.record.holder == standby.holder
    with pytest.raises(LeaseLost):           # the old holder is fenced
        holder.renew(force=True)
    lease(1).acquire(10)
    with pytest.raises(LeaseRefused):        # a newer attempt's lease, its pid named dead
        lease(0).acquire(10, dead_pid=os.getpid())


@pytest.mark.parametrize("raw", [
    b"not json", b"[1, 2]",
    b'{"attempt": "0", "epoch": -3, "beat": 1e400, "status": ["syncing"], "pid": true, '
    b'"holder": 7, "name": "", "time": "now"}'])
def test_a_malformed_lease_record_reads_as_unknown_and_is_taken_over(tmp_path, raw):
    """A broken or foreign write of the lease neither stops an observer (every field it cannot
    read is unknown) nor a syncer from taking the lease (an unknown attempt is older than any),
    and the record it writes is whole again."""
    from resources.store import layout
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store

    store = ArtifactStore(open_blob_store(str(tmp_path / "store")), "exp")
    store.blobs.write(layout.syncer_lease("exp"), raw)
    seen = store.get_syncer_lease()
    assert (seen.attempt, seen.epoch, seen.pid, seen.holder_name) == (None, 0, None, "syncer")
    assert seen.status in ("unknown",)
    clock = _Clock()
    taken = SyncerLease(store, 0, clock=clock, sleep=clock.sleep).acquire(10)
    assert clock.now == 0.0 and taken.record.epoch == 1
    assert store.get_syncer_lease() == taken.record and taken.record.pid == os.getpid()


@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=SERVICE)
        h.start()
        yield h


def _spawn(store_uri: str, attempt: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.syncer.entry", "--store", store_uri,
         "--experiment", "exp-test", "--attempt", str(attempt)],
        stdout=out.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "DILOCO_SYNCER_STANDBY": "1"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (ended, not yet reaped by its new parent) counts as ended.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _standby_pid(log: Path) -> int:
    found = re.findall(r"warm standby started \(pid (\d+)\)", log.read_text())
    return int(found[-1]) if found else 0


def _versions_by_round(store, num_fragments: int) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list] = {}
    for p in range(num_fragments):
        for v in store.versions(p):
            meta = store.version_meta(p, v)
            if meta is not None and meta.round is not None:
                out.setdefault(meta.round, []).append((p, v))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_syncer_is_replaced_by_its_standby_and_rounds_go_on_merged_once(harness,
                                                                                 tmp_path):
    h = harness
    uri = h.resource.base_uri
    log = tmp_path / "syncer.log"
    first = _spawn(uri, 0, log)
    standby = relaunched = None
    try:
        wait_until(lambda: getattr(h.store.get_syncer_lease(), "pid", None) == first.pid,
                   "the syncer's lease", 180, interval=0.2)
        wait_until(lambda: "standing by" in log.read_text(), "its standby standing by", 300,
                   interval=0.5)
        standby = _standby_pid(log)
        assert standby and _alive(standby)

        h.train_rounds(2, NAMES, ("learner-0", "learner-1"), 180)
        epoch = h.store.get_syncer_lease().epoch
        killed_at = time.time()
        os.kill(first.pid, signal.SIGKILL)       # by hand: no clean exit, the lease held
        first.wait()
        # Nothing relaunches a syncer here and the lease's stale timeout is 600 s: only the
        # standby can take it, and it does, as the same attempt, in a new epoch.
        wait_until(lambda: getattr(h.store.get_syncer_lease(), "pid", None) == standby,
                   "the standby's takeover", 120, interval=0.2)
        lease = h.store.get_syncer_lease()
        assert lease.attempt == 0 and lease.epoch == epoch + 1, lease
        shown = run_status(h.store).syncer        # what `diloco status` shows
        assert (shown.holder, shown.attempt, shown.standby) == (
            "syncer-a0-standby", 0, True), shown
        h.train_rounds(3, NAMES, ("learner-0", "learner-1"), 180)   # decided by the standby
        decided = {h.store.get_decision(r).decided_by
                   for r in range(h.store.latest_open_round().round)
                   if h.store.get_decision(r) is not None}
        assert "syncer-a0-standby" in decided, decided
        # The supervisor's relaunch (a newer attempt) takes over from the standby, which is
        # fenced and ends without writing.
        relaunched = _spawn(uri, 1, tmp_path / "relaunched.log")
        wait_until(lambda: getattr(h.store.get_syncer_lease(), "pid", None) == relaunched.pid,
                   "the relaunch's takeover", 180, interval=0.2)
        shown = run_status(h.store).syncer
        assert (shown.state, shown.holder, shown.standby) == (
            "syncing", "syncer-a1", False), shown
        h.train_rounds(2, NAMES, ("learner-0", "learner-1"), 180)
        wait_until(lambda: not _alive(standby), "the fenced standby's exit", 60, interval=0.2)
        assert "exiting without writing" in log.read_text()
        # A syncer that ends cleanly (terminated) ends its standby first and gives its lease
        # back: nobody takes it over.
        wait_until(lambda: "standing by" in (tmp_path / "relaunched.log").read_text(),
                   "the relaunch's standby", 300, interval=0.5)
        second_standby = _standby_pid(tmp_path / "relaunched.log")
        relaunched.terminate()
        relaunched.wait(60)
        assert not _alive(second_standby)
        assert h.store.get_syncer_lease().status == "released"
        assert run_status(h.store).syncer.state == "released"
    finally:
        for proc in (first, relaunched):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in (standby, _standby_pid(tmp_path / "relaunched.log")
                    if (tmp_path / "relaunched.log").exists() else 0):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
    # Every round merged at most once, whoever merged it (versions still retained); each of
    # the three syncers decided rounds, the killed one none after its kill.
    merged = _versions_by_round(h.store, 2)
    assert all(len(v) == 1 for v in merged.values()), merged
    decisions = [d for r in range(h.store.latest_open_round().round + 1)
                 if (d := h.store.get_decision(r)) is not None]
    assert {"syncer-a0", "syncer-a0-standby", "syncer-a1"} <= {
        d.decided_by for d in decisions}, decisions
    assert all(d.decided_at < killed_at for d in decisions
               if d.decided_by == "syncer-a0"), decisions


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hung_syncer_is_ended_by_its_standby_which_takes_over(tmp_path):
    """A syncer alive but stalled (SIGSTOP: it holds the lease and never renews it) is killed
    by its standby once the lease has not moved for the timeout, and the standby decides the
    rounds from then on; nothing else here could take the lease (no sensor, no relaunch)."""
    timeout = 8.0
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=[
            "orchestration.syncer=service", f"orchestration.syncer_timeout_seconds={timeout}"])
        h.start()
        log = tmp_path / "syncer.log"
        first = _spawn(h.resource.base_uri, 0, log)
        standby = 0
        try:
            wait_until(lambda: getattr(h.store.get_syncer_lease(), "pid", None) == first.pid,
                       "the syncer's lease", 180, interval=0.2)
            wait_until(lambda: "standing by" in log.read_text(), "its standby standing by",
                       300, interval=0.5)
            standby = _standby_pid(log)
            assert _alive(standby)
            h.train_rounds(1, NAMES, ("learner-0", "learner-1"), 180)
            time.sleep(2 * timeout)     # a live syncer is left alone: its lease moves
            assert _alive(first.pid) and "hung" not in log.read_text()
            os.kill(first.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            wait_until(lambda: getattr(h.store.get_syncer_lease(), "pid", None) == standby,
                       "the standby's takeover", 120, interval=0.2)
            took = time.monotonic() - stopped_at
            assert first.wait(30) == -signal.SIGKILL        # ended by its standby
            assert "is alive but has not renewed its lease" in log.read_text()
            # Not before the lease had stood still for the timeout: its last renewal came up to
            # a renewal period (1 s) before the stop, and the standby reads it once a second.
            assert took >= timeout - 2.0, f"taken over {took:.1f}s after the stall"
            h.train_rounds(2, NAMES, ("learner-0", "learner-1"), 180)   # decided by the standby
            decided_by = {d.decided_by for r in range(h.open_round_index())
                          if (d := h.store.get_decision(r)) is not None}
            assert "syncer-a0-standby" in decided_by, decided_by
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
            if standby and _alive(standby):
                os.kill(standby, signal.SIGKILL)
