"""The syncer service: decides and merges in its own process, fenced by its lease; the quorum
sensor mirrors it into Dagster and takes over while its lease is stale.

Scripted learners (tests/orchestration_harness.py) write heartbeats and offers; the service is
stepped on the harness's clock in-process, or runs as real processes racing for the lease.
"""

import json
import os
import signal
import subprocess
import sys
import time

import dagster as dg
import pytest
from orchestration_harness import JUMPS, Harness, wait_until

from pipelines.syncer.service import SyncerService
from resources.store.artifact_store import ArtifactStore
from resources.store.lease import LeaseLost, LeaseRefused, SyncerLease

pytestmark = pytest.mark.timeout(300)

SERVICE = ["orchestration.syncer=service", "orchestration.syncer_timeout_seconds=4"]
NAMES = ["learner-0", "learner-1", "learner-2"]


@pytest.fixture
def harness(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=SERVICE)
        h.start()
        yield h


def _round(h: Harness, service: SyncerService, r: int, offerers=("learner-0", "learner-1"),
           advance: float = 1.0) -> None:
    """Learners progress H/P steps, the service opens round r; `offerers` offer; the service
    decides and merges."""
    for name in NAMES:
        h.beat(name, 2)
    h.now += advance
    service.step(now=h.now)
    assert service.state["round"] == r, service.state
    for name in offerers:
        h.offer(name, r)
    h.now += advance
    service.step(now=h.now)


def _versions_by_round(store, num_fragments: int) -> dict[int, list[tuple[int, int]]]:
    """round -> [(fragment, version)] over every committed version: a round merged twice
    shows up twice."""
    out: dict[int, list] = {}
    for p in range(num_fragments):
        for v in store.versions(p):
            meta = store.version_meta(p, v)
            if meta is not None and meta.round is not None:
                out.setdefault(meta.round, []).append((p, v))
    return out


def _service_after_round_0(h: Harness, attempt: int = 0) -> SyncerService:
    """A syncer holding the lease that has decided and merged round 0."""
    service = SyncerService(h.store, attempt=attempt)
    # The lease renews once a second on its clock: the harness's scripted one here, so that
    # whether it moved between two ticks does not depend on how fast this machine is.
    service.lease.clock = lambda: h.now
    service.lease.acquire(4)
    for name in NAMES:
        h.beat(name, 0)
    _round(h, service, 0)
    return service


def test_the_service_merges_at_once_and_the_sensor_mirrors_it(harness):
    h = harness
    service = _service_after_round_0(h)
    decision = h.store.get_decision(0)
    assert decision.decided_by == "syncer-a0" and list(decision.members) == ["learner-0",
                                                                             "learner-1"]
    meta = h.store.version_meta(0)
    assert meta.round == 0 and meta.merged_by == "syncer-a0"
    # (decided_at is on the harness's scripted clock, published_at on the wall clock.)
    assert isinstance(meta.published_at, float) and meta.finite
    _round(h, service, 1)
    assert h.store.version_meta(1).round == 1
    assert h.store.get_eval(1).by == "syncer"    # once per outer step (P = 2 rounds)
    assert service.progress.decision_to_publish and len(service.progress.decision_to_publish) == 2

    # The sensor, with the lease moving, only mirrors: partitions, offers, merges, checks, eval.
    result = h.tick()
    assert not result.run_requests, result.run_requests
    assert h.instance.get_dynamic_partitions("rounds") == [h.key(0), h.key(1)]
    assert h.merged_rounds() == {h.key(0), h.key(1)}
    mirrored = h.merge_metadata(0)
    assert mirrored["merged_by"].value == "syncer-a0"
    assert mirrored["members"].value == "learner-0, learner-1"
    checks = h.instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("global_params"), "params_finite"), limit=10)
    assert len(checks) == 2
    evals = h.instance.get_materialized_partitions(dg.AssetKey("heldout_eval"))
    assert evals == {h.key(1)}
    updates = h.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("learner_update")), limit=100).records
    assert len(updates) == 4
    # Mirroring again reports nothing twice; the tick's reason (the UI's tick history) says
    # who holds the lease.
    again = h.tick()
    assert "syncer-a0 (attempt 0) holds the syncer's lease" in again.skip_reason.skip_message
    assert len(h.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("global_params")), limit=100).records) == 2


def test_a_stale_lease_hands_the_rounds_to_the_sensor_and_back_without_double_merges(harness):
    h = harness
    service = _service_after_round_0(h)
    h.tick()                                   # mirror; the sensor sees the lease
    # The service stops moving (hung): after the timeout the sensor decides and merges.
    for name in NAMES:
        h.beat(name, 2)
    h.tick(advance=5)                          # lease silent 5 s > 4 s: fallback opens round 1
    assert json.loads(h.cursor)["mode"] == "fallback"
    assert h.store.latest_open_round().round == 1
    h.offer("learner-0", 1)
    h.offer("learner-2", 1)
    h.tick()
    decision = h.store.get_decision(1)
    assert decision.decided_by == "sensor"
    assert [r.partition_key for r in h.launched if r.job_name == "merge_round"] == [h.key(1)]
    assert h.store.version_meta(1).merged_by == "run"
    # The hung service wakes up: it is behind the store, rebuilds from it, and carries on.
    for name in NAMES:
        h.beat(name, 2)
    h.now += 1
    service.step(now=h.now)
    assert service.state["round"] == 2 and h.store.get_decision(1).decided_by == "sensor"
    for name in ("learner-0", "learner-1"):
        h.offer(name, 2)
    h.now += 1
    service.step(now=h.now)
    assert h.store.version_meta(0).round == 2
    h.tick()                                   # the lease moved again: back to mirroring
    assert json.loads(h.cursor)["mode"] == "mirror"
    assert h.merged_rounds() == {h.key(0), h.key(1), h.key(2)}
    assert h.merge_metadata(2)["merged_by"].value == "syncer-a0"
    merged = _versions_by_round(h.store, 2)
    assert merged == {0: [(0, 1)], 1: [(1, 1)], 2: [(0, 2)]}


def test_a_zombie_syncer_is_fenced_before_it_writes(harness):
    h = harness
    old = _service_after_round_0(h)
    new = SyncerService(h.store, attempt=1)
    new.lease.acquire(4)                        # a newer attempt takes over at once
    for name in NAMES:
        h.beat(name, 2)
    h.now += 1
    with pytest.raises(LeaseLost):
        old.step(now=h.now)                     # would open round 1: refused before writing
    assert h.store.latest_open_round().round == 0
    new.step(now=h.now)
    assert h.store.get_round_open(1) is not None
    # Nor can the zombie take the lease back: a newer attempt holds it.
    with pytest.raises(LeaseRefused):
        SyncerLease(h.store, attempt=0).acquire(1)


def _spawn(store_uri: str, attempt: int, out_path) -> subprocess.Popen:
    out = open(out_path, "w")  # noqa: SIM115 - the process owns it until it exits
    # No warm standby: a standby ends a holder whose lease stands still for
    # syncer_timeout_seconds (4 s here) with SIGKILL, so the frozen holder below would be
    # killed, not fenced, whenever the newer attempt takes longer than that to start (a loaded
    # CI machine did: -9). The standby's own take-over is tests/test_syncer_failover.py's.
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.syncer.entry", "--store", store_uri,
         "--experiment", "exp-test", "--attempt", str(attempt)],
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "DILOCO_SYNCER_STANDBY": "0"})


@pytest.mark.slow
def test_real_syncer_processes_race_for_the_lease(harness, tmp_path):
    """Two processes of one attempt: one syncs, the other is refused. A third, newer attempt
    takes over from a stopped (SIGSTOP) holder; the holder, resumed, is fenced and exits
    without writing; every round is merged exactly once."""
    h = harness
    uri = h.resource.base_uri
    first = _spawn(uri, 0, tmp_path / "a.log")
    second = None
    try:
        wait_until(lambda: getattr(h.store.get_syncer_lease(), "pid", None) == first.pid,
                   "the first syncer's lease", 120, interval=0.2)
        second = _spawn(uri, 0, tmp_path / "b.log")
        assert second.wait(120) == 0
        assert "refused" in (tmp_path / "b.log").read_text()
        assert h.store.get_syncer_lease().pid == first.pid

        h.train_rounds(3, NAMES, ("learner-0", "learner-1"), 120)
        os.kill(first.pid, signal.SIGSTOP)      # the holder freezes (a long GC, a VM pause)
        takeover_at = time.time()
        third = _spawn(uri, 1, tmp_path / "c.log")
        try:
            wait_until(lambda: getattr(h.store.get_syncer_lease(), "pid", None) == third.pid,
                       "the newer attempt's takeover", 120, interval=0.2)
            h.train_rounds(3, NAMES, ("learner-0", "learner-1"), 120)
            os.kill(first.pid, signal.SIGCONT)  # the zombie wakes up mid-loop
            assert first.wait(60) == 0
            assert "exiting without writing" in (tmp_path / "a.log").read_text()
            h.train_rounds(2, NAMES, ("learner-0", "learner-1"), 120)
        finally:
            third.terminate()
            third.wait(60)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    merged = _versions_by_round(h.store, 2)
    assert all(len(v) == 1 for v in merged.values()), merged
    last = h.store.latest_open_round().round
    for r in range(last):
        decision = h.store.get_decision(r)
        assert decision is not None, r
        # Nothing the zombie decided or merged after the takeover.
        if decision.decided_by == "syncer-a0":
            assert decision.decided_at < takeover_at + 1, decision
    assert any(h.store.get_decision(r).decided_by == "syncer-a1" for r in range(last))


def test_an_operators_stop_ends_the_run_through_the_final_rounds_before_the_budget(harness,
                                                                                   capsys):
    """`diloco stop` / the `stop` job: the syncer writes STOP at its next tick, as at the
    budget, so the final rounds still merge every learner's last progress."""
    from pipelines.commands.cli import main

    h = harness
    service = _service_after_round_0(h)
    result = h.defs.resolve_job_def("stop").execute_in_process(
        instance=h.instance, run_config={"ops": {"request_run_stop": {"config": {
            "reason": "capacity reclaimed"}}}})
    assert result.success
    assert h.store.stop_request()["reason"] == "capacity reclaimed"
    assert h.store.stop_requested() is None           # a request, not yet STOP
    tokens = sum(h.tokens.values())
    assert tokens < h.cfg.token_budget
    # A second request (here from the CLI) changes nothing and says why.
    assert main(["stop", "--store", h.resource.base_uri]) == 0
    assert "already requested" in capsys.readouterr().out

    from pipelines.syncer.round_control import STOP_REQUEST_POLL_SECONDS

    h.now += STOP_REQUEST_POLL_SECONDS   # the syncer reads the request at most this often
    service.step(now=h.now)
    stop = h.store.stop_requested()
    assert "stop requested by" in stop["reason"] and "capacity reclaimed" in stop["reason"]
    assert stop["final_left"] == h.cfg.sync.num_fragments
    final = []
    for _ in range(10):
        opened = h.store.latest_open_round()
        if opened is not None and opened.final and opened.round not in final:
            final.append(opened.round)
            for name in NAMES:
                h.offer(name, opened.round)
        h.now += 1.0
        service.step(now=h.now)
        if h.store.finished() is not None:
            break
    assert h.store.finished() is not None
    assert final == [1, 2]                             # one final round per fragment
    for r in final:
        assert list(h.store.get_decision(r).members) == NAMES
    assert {p: h.store.version_meta(p).round for p in range(2)} == {0: 2, 1: 1}
    assert main(["stop", "--store", h.resource.base_uri]) == 0
    assert "already finished" in capsys.readouterr().out


def test_a_tick_replayed_after_its_cursor_was_lost_does_not_wedge_the_sensor(harness):
    """The daemon killed after a tick's events were stored but before its cursor was: the next
    tick mirrors the same rounds again. Dagster refuses a second runless check evaluation per
    partition, which failed every later tick (seen in a fresh-clone CI run's instance
    restart); the mirror skips the evaluations the instance already holds."""
    h = harness
    service = _service_after_round_0(h)
    _round(h, service, 1)
    before = h.cursor
    h.tick()                                             # mirrors rounds 0 and 1
    h.cursor = before                                    # ... and its cursor is lost
    h.tick()                                             # the same rounds again: no error
    checks = h.instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("global_params"), "params_finite"), limit=10)
    assert sorted(c.partition for c in checks) == [h.key(0), h.key(1)]
    _round(h, service, 2)
    h.tick()                                             # and the sensor goes on
    assert h.key(2) in h.merged_rounds()


def _payloads(store, directory: str) -> list[str]:
    return [k for k in store.blobs.list(directory + "/") if k.endswith(".npz")]


def test_retention_deletes_what_left_the_window_and_a_new_syncer_carries_on(tmp_path,
                                                                          monkeypatch):
    """keep 2 versions per fragment and 2 rounds of contributions: after 8 rounds (P = 2, so
    versions 0..4 of each fragment) the arrays of versions 1-2 and of rounds 0-5 are gone,
    every manifest and record stays (the records of rounds 0-3 packed into archive blocks of
    2 rounds, read from there), an offer based on a pruned version is refused with the
    reason, and the next syncer resumes from the retention record."""
    from resources.store import layout, record_archive
    from resources.store.artifact_store import Pruned

    monkeypatch.setattr(record_archive, "BLOCK_ROUNDS", 2)

    keep = ["orchestration.keep_global_versions=2", "orchestration.keep_contribution_rounds=2"]
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=SERVICE + keep)
        h.start()
        service = _service_after_round_0(h)
        for r in range(1, 8):
            _round(h, service, r)
        exp, store = h.store.experiment, h.store
        for p in range(2):
            assert store.versions(p) == [0, 1, 2, 3, 4]               # every manifest
            kept = [v for v in range(5) if _payloads(store, layout.version_dir(exp, p, v))]
            assert kept == [0, 3, 4], (p, kept)
        with pytest.raises(Pruned, match="keep_global_versions=2"):
            store.load_global(0, 2)
        pruned = [r for r in range(8) if not _payloads(store, layout.round_dir(exp, r))]
        assert pruned == [0, 1, 2, 3, 4, 5]
        assert all(store.list_contributions(r) == ["learner-0", "learner-1"] for r in range(8))
        assert list(store.get_decision(0).members) == ["learner-0", "learner-1"]
        assert store.get_retention() == {"versions_from": [3, 3], "rounds_from": 6}
        # Rounds 0-5 are pruned: three blocks packed, four steps a merge, so the last merge
        # sealed rounds 4-5 and left round 5's records to delete at the next one.
        assert store.archive.pointer() == {"through": 6, "cleaned": 5}
        assert [r for r in range(8) if store.blobs.list(layout.round_dir(exp, r) + "/")] == [
            5, 6, 7]
        assert service.record()["pruned_objects"] > 2 * 2 * 2 + 6 * 2      # and the records
        fresh = ArtifactStore(store.blobs, exp)
        assert [fresh.list_contributions(r) for r in range(8)] == [["learner-0", "learner-1"]] * 8
        assert [fresh.get_decision(r).round for r in range(8)] == list(range(8))
        # Versions 1-2 are pruned: each fragment's block of versions 0-1 is packed (version
        # 0, the initial parameters, stays in place), and reads the same.
        assert [store.version_archive(p).pointer()["through"] for p in range(2)] == [2, 2]
        assert not store.blobs.list(layout.version_dir(exp, 0, 1) + "/")
        assert fresh.versions(0) == [0, 1, 2, 3, 4] and fresh.version_meta(0, 1).round == 0
        with pytest.raises(Pruned, match="keep_global_versions=2"):
            fresh.load_global(0, 1)
        assert fresh.load_global(0, 0).version == 0

        # Each block of rounds carries the token ledger's digest of them: a ledger reads the
        # fates of rounds 0-5 there, the same answers as from every record (and as the
        # scripted run: both offers of every round merged), reading rounds 6-7 only.
        from pipelines.token_ledger import offer_fates

        assert all(store.archive.digest(first) is not None for first in (0, 2, 4))
        by_records = offer_fates(ArtifactStore(store.blobs, exp), 2, NAMES, [], digests=False)
        assert by_records[1] == {(r, n): "merged" for r in range(8)
                                 for n in ("learner-0", "learner-1")}
        reader, asked = ArtifactStore(store.blobs, exp), []
        read_decision = reader.get_decision
        monkeypatch.setattr(reader, "get_decision", lambda r: asked.append(r) or read_decision(r))
        assert offer_fates(reader, 2, NAMES, [], digests=True) == by_records
        assert asked == [6, 7]
        # A digest that does not check (a fate no offer can have) is not used: its block's
        # records answer, the same.
        from resources.store.record_archive import encode_block, read_block

        family = store.archive.family
        block = read_block(store.blobs.read(family.block(0)), exp, family, 0)
        entry = block.digest[0]
        forged = {**entry, "offers": {**entry["offers"], "learner-0": {
            **entry["offers"]["learner-0"], "fate": "stolen"}}}
        store.blobs.write(family.block(0), encode_block(exp, family, 0, block.objects,
                                                        {**block.digest, 0: forged}))
        reader, asked = ArtifactStore(store.blobs, exp), []
        read_decision = reader.get_decision
        monkeypatch.setattr(reader, "get_decision", lambda r: asked.append(r) or read_decision(r))
        assert offer_fates(reader, 2, NAMES, [], digests=True) == by_records
        assert asked == [0, 1, 6, 7]

        # Round 8 (fragment 0, current version 4): learner-2's offer is based on version 2,
        # whose arrays are gone: refused with the reason; the others merge.
        for name in NAMES:
            h.beat(name, 2)
        h.now += 1
        service.step(now=h.now)
        h.offer("learner-0", 8)
        h.offer("learner-1", 8)
        h.offer("learner-2", 8, base_version=2)
        h.now += 1
        service.step(now=h.now)
        meta = store.version_meta(0)
        assert meta.round == 8 and list(meta.members) == ["learner-0", "learner-1"]
        assert "no longer kept" in meta.rejected["learner-2"]

        # A relaunched syncer carries on from the record: round 9 prunes round 7 and
        # fragment 1's version 3, nothing before.
        successor = SyncerService(h.store, attempt=1)
        assert (successor.retention.versions_from, successor.retention.rounds_from) == (
            [4, 3], 7)


def _finish(h: Harness, service: SyncerService) -> None:
    """The budget reached: the service runs the final rounds (everyone offers) to FINISHED."""
    for name in NAMES:
        h.beat(name, h.cfg.token_budget)     # far past the budget: STOP at the next tick
    for _ in range(20):
        h.now += 1.0
        service.step(now=h.now)
        opened = h.store.latest_open_round()
        if opened is not None and opened.final:
            for name in NAMES:
                if h.store.contribution_manifest(opened.round, name) is None:
                    h.offer(name, opened.round)
        if h.store.finished() is not None:
            return
    raise AssertionError("the final rounds did not finish")


@pytest.fixture
def jumping(tmp_path):
    """A service harness whose scripted learners may jump past the budget (`JUMPS`)."""
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=SERVICE + JUMPS)
        h.start()
        yield h


def test_the_service_writes_the_summary_with_its_own_evals_once_the_learners_ended(
        jumping, monkeypatch):
    """At FINISHED the syncer waits for every learner's last process to end (their ledger
    records are final then), then writes the summary with the evals it made with its warm
    program; the `summarize` run records it in Dagster without evaluating again."""
    import pipelines.run_summary as run_summary

    h = jumping
    service = _service_after_round_0(h)
    service.progress.initial_eval = run_summary.evaluate_global(h.store, version=0)
    _finish(h, service)
    assert service.progress.last_eval is not None     # the final eval, after the last final merge
    assert service.progress.last_eval.versions == tuple(h.store.current_version(p)
                                                        for p in range(2))

    # Learners still "stopping" (offering, checkpointing): the syncer waits for them.
    for name in NAMES:
        h.beat(name, h.cfg.token_budget, status="stopping")
    assert not run_summary.learners_ended(h.store, h.cfg)
    for name, status in zip(NAMES, ("done", "left", "stopping"), strict=True):
        h.beat(name, h.cfg.token_budget, status=status)
    assert not run_summary.learners_ended(h.store, h.cfg)
    h.beat(NAMES[2], h.cfg.token_budget, status="failed")
    assert run_summary.learners_ended(h.store, h.cfg)

    def no_second_eval(*args, **kwargs):
        raise AssertionError("evaluated again although the syncer's evals were current")

    monkeypatch.setattr(run_summary, "evaluate_global", no_second_eval)
    service._summarize()
    summary = h.store.get_summary()
    assert summary.summarized_by == "syncer-a0"
    assert summary.outcome.initial_eval_loss == service.progress.initial_eval.loss
    assert summary.outcome.final_eval_loss == service.progress.last_eval.loss
    # (the harness's offers are synthetic: the losses differ, without a direction)
    assert summary.outcome.final_eval_loss != summary.outcome.initial_eval_loss
    assert summary.evals.final.versions == service.progress.last_eval.versions != (0, 0)

    result = h.defs.resolve_job_def("summarize").execute_in_process(instance=h.instance)
    assert result.success
    recorded = h.store.get_summary()
    assert recorded.summarized_by == "summarize"
    assert recorded.outcome.final_eval_loss == summary.outcome.final_eval_loss


def test_the_summary_evaluates_again_where_a_given_eval_saw_other_versions(harness,
                                                                            monkeypatch):
    """An eval made before the last merge (or on other batches) is never passed off as the
    final one."""
    import pipelines.run_summary as run_summary
    from resources.store.summary_records import Evals

    h = harness
    service = _service_after_round_0(h)
    _round(h, service, 1)
    stale = run_summary.evaluate_global(h.store).model_copy(update={"versions": (0, 0)})
    other_batches = stale.model_copy(update={
        "versions": tuple(h.store.current_version(p) for p in range(2)),
        "batches": stale.batches + 1})
    calls = []
    original = run_summary.evaluate_global
    monkeypatch.setattr(run_summary, "evaluate_global",
                        lambda *a, **k: calls.append(k.get("version")) or original(*a, **k))
    run_summary.build_summary(h.store, evals=Evals(initial=stale, final=stale))
    assert calls == [None]          # the version-0 eval was current as the initial one
    calls.clear()
    run_summary.build_summary(h.store, evals=Evals(initial=None, final=other_batches))
    assert calls == [0, None]


def _starting_syncer_run(h):
    """A syncer run the supervisor launched, started, that has not taken the lease yet."""
    return h.instance.create_run_for_job(
        job_def=h.defs.resolve_job_def("syncer"),
        run_config={"ops": {"run_syncer": {"config": {"attempt": 0}}}},
        tags={"diloco/experiment": h.store.experiment, "diloco/syncer": "1"},
        status=dg.DagsterRunStatus.STARTED)


def test_at_start_up_a_syncer_run_on_its_way_to_the_lease_is_not_judged_dead(harness):
    """Before any lease, a syncer run that is starting (a run launch and imports take longer
    than the lease's timeout on a loaded machine) gets the supervisor's allowance: the sensor
    keeps mirroring instead of logging a false "deciding here". With no such run, or past the
    allowance, it decides as before."""
    h = harness                                   # syncer_timeout_seconds=4
    run = _starting_syncer_run(h)
    for name in NAMES:
        h.beat(name, 2)
    h.tick()
    result = h.tick(advance=10)                   # 11 s without a lease, the run 11 s old
    assert json.loads(h.cursor)["mode"] == "mirror"
    assert "no syncer has taken the lease yet" in result.skip_reason.skip_message
    assert h.store.latest_open_round() is None    # the sensor opened nothing
    h.instance.report_run_failed(run)             # the run failed: nobody is coming
    h.tick()
    assert json.loads(h.cursor)["mode"] == "fallback"
    assert h.store.latest_open_round().round == 0


def test_at_start_up_a_syncer_run_that_never_takes_the_lease_is_decided_around(harness):
    h = harness
    _starting_syncer_run(h)
    for name in NAMES:
        h.beat(name, 2)
    h.tick()
    h.tick(advance=10)
    assert json.loads(h.cursor)["mode"] == "mirror"
    h.tick(advance=3 * 4 + 60)                    # past the supervisor's allowance
    assert json.loads(h.cursor)["mode"] == "fallback"
