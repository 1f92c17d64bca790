"""Control-plane faults on the real Dagster path: the daemon, the webserver and the whole
instance restarted mid-run by a fault tape (the instance as a production deployment runs it:
code server, webserver and daemon as separate processes)."""

import json
import uuid

import dagster as dg
import pytest
from test_end_to_end import E2E

from diloco_core.round_records import RoundDecision
from diloco_core.stored_merge import StoredMerge
from pipelines.commands.cli import load_config
from pipelines.commands.dagster_dev import reap_orphaned_runs
from pipelines.commands.demo import run_demo
from resources.store import layout
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store

TAPE = {"seed": 3, "faults": [
    {"id": "daemon-1", "kind": "daemon_restart", "at_seconds": 40},
    {"id": "webserver-1", "kind": "webserver_restart", "at_seconds": 60},
    {"id": "instance-1", "kind": "instance_restart", "at_seconds": 85},
]}


def test_reaping_marks_only_in_progress_runs_failed(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    statuses = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING,
                dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.NOT_STARTED,
                dg.DagsterRunStatus.SUCCESS]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        ids = []
        for status in statuses:
            run = dg.DagsterRun(job_name="learner", run_id=str(uuid.uuid4()), status=status)
            instance.add_run(run)
            ids.append(run.run_id)
    reaped = reap_orphaned_runs(home)
    assert sorted(reaped) == sorted(ids[:3])
    with dg.DagsterInstance.from_config(str(home)) as instance:
        after = [instance.get_run_by_id(i).status for i in ids]
    assert after == [dg.DagsterRunStatus.FAILURE] * 3 + statuses[3:]   # the rest stay as they were


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_daemon_webserver_and_instance_restarts_lose_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_TICK_SECONDS", "2")
    cfg = load_config(None, E2E + ["token_budget=400000"])
    tape = tmp_path / "tape.json"
    tape.write_text(json.dumps(TAPE))
    out = tmp_path / "summary.json"
    code = run_demo(cfg, chaos=False, json_path=str(out), workdir=str(tmp_path / "demo"),
                    port=None, timeout=700, fault_tape_path=str(tape))
    assert code == 0
    s = json.loads(out.read_text())
    store = ArtifactStore(open_blob_store(str(tmp_path / "demo" / "store")), cfg.name)

    assert [r["kind"] for r in s["restarts"]] == [f["kind"] for f in TAPE["faults"]]
    assert s["faults_fired"] == {"daemon_restart": 1, "webserver_restart": 1,
                                 "instance_restart": 1}
    crash = s["restarts"][-1]
    assert crash["reaped_runs"] >= 1            # the learner runs the crash left "started"
    merged = [r for r in s["rounds"] if r["merged"]]
    for restart in s["restarts"]:
        # The global model advances after every restart (resumes after the instance's).
        assert any(r["published_at"] > restart["at"] + restart["seconds"] for r in merged), \
            restart
    for rejoin in s["rejoins"]:                 # every learner died with the instance ...
        assert rejoin["kind"] == "instance_restart"
        assert rejoin["back_in_round"] is not None, rejoin   # ... and rejoined
        assert rejoin["rounds_missed"] <= 8
    assert {r["learner"] for r in s["rejoins"]} == set(cfg.learners.learner_names)

    commits = {}
    for p in range(cfg.sync.num_fragments):
        versions = store.versions(p)
        assert versions == list(range(len(versions)))          # contiguous, none orphaned
        commits[p] = [store.version_meta(p, v).round for v in versions[1:]]
        assert commits[p] == sorted(commits[p])                 # in round order
    # No decided round lost, none merged twice, none without a decision: checked against the
    # decision records the deciders wrote (not the summary, which reads the same manifests).
    decisions, not_merged = _decision_records(store)
    assert len(decisions) >= len(merged) > 0
    assert _lost_or_foreign_rounds(decisions, not_merged, commits) == []

    ledger = s["ledger"]
    assert ledger["balanced"], ledger["problems"]
    # A crash leaves no final record: the attempts alive at the crash are accounted up to their
    # last heartbeat, and only those are inexact.
    assert set(ledger["inexact_attempts"]) <= {f"{n}/0" for n in cfg.learners.learner_names}
    assert ledger["tokens"]["merged"] > 0.3 * ledger["tokens_processed"]
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.2


def _decision_records(store: ArtifactStore
                      ) -> tuple[dict[int, RoundDecision], dict[int, StoredMerge]]:
    """Every round's decision record in the store, found by listing (not by the summary's
    walk of the opened rounds), and the not-merged record of those that have one."""
    prefix = f"{layout.experiment(store.experiment)}/rounds/r"
    rounds = sorted({int(key[len(prefix):].split("/")[0]) for key in store.blobs.list(prefix)
                     if key.endswith("/decision.json")})
    decisions = {r: store.get_decision(r) for r in rounds}
    not_merged = {r: rec for r in rounds if (rec := store.get_round_not_merged(r)) is not None}
    return decisions, not_merged


def _lost_or_foreign_rounds(decisions: dict[int, RoundDecision], not_merged: dict[int, StoredMerge],
                            commits: dict[int, list[int]]) -> list[str]:
    """What breaks "every round decided with members is committed exactly once, in its
    fragment, unless a record says why not; and every committed round was decided with
    members". `commits`: fragment -> the round of each committed version after the first."""
    problems = []
    committed: dict[int, list[int]] = {}
    for fragment, rounds in commits.items():
        for r in rounds:
            committed.setdefault(r, []).append(fragment)
    for r, decision in decisions.items():
        where = committed.get(r, [])
        if decision.members and r in not_merged:
            if where:
                problems.append(f"round {r} is committed ({where}) and recorded not merged")
        elif decision.members and where != [decision.fragment]:
            problems.append(f"round {r} (decided, fragment {decision.fragment}, members "
                            f"{list(decision.members)}) is committed in fragments {where}")
        elif not decision.members and where:
            problems.append(f"round {r} was decided with no members but committed in {where}")
    for r, where in sorted(committed.items()):
        if r not in decisions:
            problems.append(f"round {r} is committed in fragments {where} with no decision")
    return problems


def test_the_round_check_fails_on_a_lost_double_or_undecided_commit():
    """The restart test's check is not a tautology: each way of breaking it is reported."""
    decisions = {r: RoundDecision(r, fragment, members, "", 0.0) for r, fragment, members in
                 ((0, 0, ("a",)), (1, 1, ("a",)), (2, 0, ()), (3, 1, ("b",)))}
    fine = {0: [0], 1: [1, 3]}
    assert _lost_or_foreign_rounds(decisions, {}, fine) == []
    assert _lost_or_foreign_rounds(decisions, {3: {"reason": "all refused"}}, {0: [0], 1: [1]}
                                   ) == []
    assert _lost_or_foreign_rounds(decisions, {}, {0: [0], 1: [1]}) == [
        "round 3 (decided, fragment 1, members ['b']) is committed in fragments []"]
    assert _lost_or_foreign_rounds(decisions, {}, {0: [0, 0], 1: [1, 3]}) == [
        "round 0 (decided, fragment 0, members ['a']) is committed in fragments [0, 0]"]
    assert _lost_or_foreign_rounds(decisions, {}, {0: [0, 3], 1: [1]}) == [
        "round 3 (decided, fragment 1, members ['b']) is committed in fragments [0]"]
    assert _lost_or_foreign_rounds(decisions, {}, {0: [0, 2], 1: [1, 3]}) == [
        "round 2 was decided with no members but committed in [0]"]
    assert _lost_or_foreign_rounds(decisions, {}, {0: [0, 4], 1: [1, 3]}) == [
        "round 4 is committed in fragments [0] with no decision"]
    assert _lost_or_foreign_rounds(decisions, {1: {"reason": "x"}}, fine) == [
        "round 1 is committed ([1]) and recorded not merged"]
