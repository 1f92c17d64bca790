"""Control-plane faults on the real Dagster path: the daemon, the webserver and the whole
instance restarted mid-run by a fault tape (the instance as a production deployment runs it:
code server, webserver and daemon as separate processes)."""

import json
import uuid

import dagster as dg
import pytest
from test_end_to_end import E2E

from pipelines.cli import load_config
from pipelines.dagster_dev import reap_orphaned_runs
from pipelines.demo_command import run_demo
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

    committed = []
    for p in range(cfg.sync.num_fragments):
        versions = store.versions(p)
        assert versions == list(range(len(versions)))          # contiguous, none orphaned
        rounds = [store.version_meta(p, v)["round"] for v in versions[1:]]
        assert rounds == sorted(set(rounds))                    # each round at most once
        committed += rounds
    for r in merged:
        assert r["round"] in committed                          # no decided round lost

    ledger = s["ledger"]
    assert ledger["balanced"], ledger["problems"]
    # A crash leaves no final record: the attempts alive at the crash are accounted up to their
    # last heartbeat, and only those are inexact.
    assert set(ledger["inexact_attempts"]) <= {f"{n}/0" for n in cfg.learners.learner_names}
    assert ledger["tokens"]["merged"] > 0.3 * ledger["tokens_processed"]
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.2
