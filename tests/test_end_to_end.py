"""End to end on the real Dagster daemon: `dagster dev` on a temporary DAGSTER_HOME, the sensors
on their own, learner processes and the syncer service dispatched through Pipes, one learner
killed mid-run, then the syncer.

Asserts what the product promises: merges continued while the learner was down, it was
relaunched and rejoined (its contributions were merged again), merges continued through the
sensor fallback while the syncer was down and the relaunched syncer took over, no round was
merged twice or lost, and the held-out loss fell.
Learners run the tiny model with emulated 0.1 s steps (`orchestration.step_seconds_floor`) so
rounds are seconds apart and the test stays light on a 2-core machine.

The first run keeps the Dagster instance's storage in a real PostgreSQL server (dagster-postgres,
as production does; the server is started by the `postgres_url` fixture), the GCS one in SQLite.
Two fast tests check the PostgreSQL instance configuration on its own.
"""

import json
import uuid
from pathlib import Path

import pytest
import yaml
from gcs_emulator import BUCKET
from postgres_server import materialize_one_run

from pipelines.commands.cli import load_config
from pipelines.commands.dagster_dev import instance_yaml
from pipelines.commands.demo import run_demo

# The two daemon runs are slow-marked one by one; the PostgreSQL configuration tests are fast.

E2E = ["name=e2e", "model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
       "learners.num_learners=3", "learners.speeds=[1.0, 1.0, 0.8]",
       "orchestration.step_seconds_floor=0.1", "sync.sync_period=120", "sync.num_fragments=2",
       "sync.min_quorum=2", "sync.grace_min_seconds=1", "token_budget=300000",
       "orchestration.eval_batches=1",
       "orchestration.checkpoint_every_steps=10", "orchestration.heartbeat_seconds=1",
       "orchestration.learner_timeout_seconds=15", "orchestration.restart_backoff_seconds=15",
       "orchestration.round_timeout_seconds=60", "orchestration.syncer_timeout_seconds=6"]


def _run(tmp_path, monkeypatch, overrides=(), store_uri=None, postgres_url=None):
    monkeypatch.setenv("DILOCO_TICK_SECONDS", "2")
    # These runs exercise the paths that bridge a syncer with no standby (the sensor's
    # fallback, the supervisor's relaunch); the standby's takeover is
    # tests/test_syncer_failover.py (real processes) and benchmarks/syncer_failover.py.
    monkeypatch.setenv("DILOCO_SYNCER_STANDBY", "0")
    cfg = load_config(None, E2E + list(overrides))
    out = tmp_path / "summary.json"
    code = run_demo(cfg, chaos=True, json_path=str(out), workdir=str(tmp_path / "demo"),
                    port=None, timeout=600, store_uri=store_uri, postgres_url=postgres_url)
    assert code == 0, (tmp_path / "demo" / "dagster_home" / "dagster-dev.log").read_text()[-5000:]
    _summarized(tmp_path / "demo" / "dagster_home")
    return json.loads(out.read_text())


def _summarized(home: Path) -> None:
    """The instance's `summarize` runs all succeeded: the demo shut Dagster down only after
    they ended (before, the one that recorded the summary was interrupted, a failed run)."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:
        statuses = [r.status for r in instance.get_runs(dg.RunsFilter(job_name="summarize"))]
    assert statuses and set(statuses) == {dg.DagsterRunStatus.SUCCESS}, statuses


def _check(summary):
    assert summary["failures_injected"] == 1
    (killed,) = summary["killed"]
    victim = killed["learner"]
    assert summary["learners_rejoined"] == [victim]
    assert summary["learner_restarted_at"][victim] > killed["at"]
    after = [r for r in summary["rounds"] if r["merged"] and r["published_at"] > killed["at"]]
    # An offer committed just before the kill may still be merged; then merges go on without
    # it (zero global downtime), and it is merged again within a bounded number of rounds.
    admitted = [victim in r["admitted"] for r in after]
    gone = admitted.index(False)
    back = admitted.index(True, gone)
    assert 1 <= back - gone <= 8, [r["admitted"] for r in after]
    assert summary["rounds_merged"] >= 3
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.2
    assert summary["uptime"] > 0.5
    for r in summary["rounds"]:
        assert set(r["admitted"]).isdisjoint(r["late"])
    # The syncer service was killed too: the quorum sensor decided rounds meanwhile (and
    # requested their merge runs; whichever of a run and the relaunched syncer gets there
    # first commits), then the relaunched syncer (attempt 1) took over again.
    (syncer_kill,) = summary["syncer_killed"]
    decided_after = [r for r in summary["rounds"] if r["published_at"]
                     and r["published_at"] > syncer_kill["at"]]
    assert "sensor" in {r["decided_by"] for r in decided_after}, decided_after
    # A relaunched syncer held the lease: it merged rounds (the sensor's, if it got there
    # before their merge runs) or decided the final ones (which may have nothing to merge).
    relaunched = {k for k in [*summary["merged_by"], *summary["decided_by"]]
                  if k.startswith("syncer-a") and k != "syncer-a0"}
    assert relaunched, (summary["merged_by"], summary["decided_by"])
    # Every decided round with members was merged once (rounds_merged counts versions) or
    # says why not; the token ledger balances.
    decided = [r for r in summary["rounds"] if r["admitted"]]
    assert all(r["merged"] or r.get("not_merged_reason") for r in decided), decided
    assert summary["rounds_merged"] == sum(r["merged"] for r in decided)
    assert summary["ledger"]["balanced"], summary["ledger"]
    assert summary["decision_to_publish_seconds"]["median"] is not None


def _pg_query(url: str, sql: str) -> list[tuple]:
    import psycopg2

    connection = psycopg2.connect(url)
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql)
            return cursor.fetchall()
    finally:
        connection.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_daemon_run_on_postgres_with_a_killed_learner_keeps_merging_and_rejoins(
        tmp_path, monkeypatch, postgres_url):
    _check(_run(tmp_path, monkeypatch, postgres_url=postgres_url))
    # The instance really ran on PostgreSQL: every run (the train job, the learners, their
    # relaunch, the merges, the summary) and the daemon's sensor ticks are rows there, and
    # no SQLite run storage was created in DAGSTER_HOME.
    runs = dict(_pg_query(postgres_url, "SELECT pipeline_name, count(*) FROM runs "
                                        "GROUP BY pipeline_name"))
    assert {"train", "learner", "merge_round", "summarize"} <= set(runs), runs
    assert runs["learner"] >= 4, runs  # three learners and the killed one's relaunch
    assert _pg_query(postgres_url, "SELECT count(*) FROM job_ticks")[0][0] > 0
    home = tmp_path / "demo" / "dagster_home"
    assert "postgres" in yaml.safe_load((home / "dagster.yaml").read_text())["storage"]
    assert not list(home.rglob("*.db")), list(home.rglob("*.db"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_daemon_run_on_the_loopback_gcs_server(tmp_path, monkeypatch, gcs_server):
    # The loopback server is a pure-Python process shared with this test: fewer, larger
    # requests (Orbax checkpoints make hundreds each) keep the run short.
    summary = _run(tmp_path, monkeypatch,
                   ["orchestration.checkpoint_every_steps=60", "orchestration.poll_seconds=1"],
                   store_uri=f"gs://{BUCKET}/e2e-{uuid.uuid4().hex[:8]}")
    _check(summary)


def test_an_instance_with_a_postgres_url_stores_runs_in_postgres(tmp_path, postgres_url):
    import dagster as dg
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

    config = instance_yaml(4, postgres_url)
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(config))

    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        run_id = materialize_one_run(instance)
        (run,) = instance.get_runs()
        assert run.run_id == run_id and run.is_success
    assert _pg_query(postgres_url, "SELECT run_id FROM runs") == [(run_id,)]
    assert not list(Path(tmp_path).rglob("*.db"))


@pytest.mark.parametrize("url", ["sqlite:///x.db", "postgres://u@h/db", "postgresql://u@h:x/db"])
def test_a_bad_postgres_url_is_refused_before_anything_starts(tmp_path, url, capsys):
    from pipelines.commands.cli import main

    assert main(["demo", "--workdir", str(tmp_path / "demo"), "--postgres-url", url]) == 2
    assert "invalid --postgres-url" in capsys.readouterr().err
    with pytest.raises(ValueError, match="PostgreSQL URL"):
        instance_yaml(4, url)
    cfg = load_config(None, E2E)
    with pytest.raises(ValueError, match="PostgreSQL URL"):
        run_demo(cfg, chaos=False, json_path=None, workdir=str(tmp_path / "demo"), port=None,
                 timeout=1, postgres_url=url)
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_daemon_run_where_a_learner_joins_and_another_leaves(tmp_path, monkeypatch):
    # Scavenged capacity on the real daemon: learner-3 starts on standby and joins when round
    # 3 opens; learner-1's capacity is reclaimed when round 8 opens. A fault tape drives both
    # (the learner supervisor applies them), so the run replays exactly. Rounds every 30 steps
    # (~3 s): about 25 rounds, so the run goes on well past the leave.
    tape = tmp_path / "capacity.json"
    tape.write_text(json.dumps({"faults": [
        {"id": "join-3", "kind": "learner_join", "learner": "learner-3", "at_round": 3},
        {"id": "leave-1", "kind": "learner_leave", "learner": "learner-1", "at_round": 8}]}))
    monkeypatch.setenv("DILOCO_TICK_SECONDS", "2")
    cfg = load_config(None, [*E2E, "learners.num_learners=4", "learners.standby=1",
                             "learners.speeds=[1.0, 1.0, 0.8, 1.0]", "sync.sync_period=60"])
    out = tmp_path / "summary.json"
    code = run_demo(cfg, chaos=False, json_path=str(out), workdir=str(tmp_path / "demo"),
                    port=None, timeout=600, fault_tape_path=str(tape))
    assert code == 0, (tmp_path / "demo" / "dagster_home" / "dagster-dev.log").read_text()[-5000:]
    _summarized(tmp_path / "demo" / "dagster_home")
    s = json.loads(out.read_text())
    changes = {c["learner"]: c for c in s["capacity"]["changes"]}
    assert [(c["learner"], c["action"]) for c in s["capacity"]["changes"]] == [
        ("learner-3", "join"), ("learner-1", "leave")]
    assert changes["learner-3"]["round"] >= 3 and changes["learner-1"]["round"] >= 8
    assert s["capacity"]["absent"] == ["learner-1"]
    rounds = [r for r in s["rounds"] if r["admitted"]]
    # The joiner: never in a round before it joined, merged after it did.
    joined_at = changes["learner-3"]["round"]
    assert all("learner-3" not in r["admitted"] for r in rounds if r["round"] <= joined_at)
    assert any("learner-3" in r["admitted"] for r in rounds if r["round"] > joined_at)
    assert s["learner_started_from"]["learner-3"].startswith("peer"), s["learner_started_from"]
    # The leaver: it offers what it has to the next rounds (at most one per fragment, and a
    # round in flight), then never again; no round waits for it once the controller has read
    # the record (every few seconds).
    left_at = changes["learner-1"]["round"]
    P = cfg.sync.num_fragments
    after = [r for r in rounds if r["round"] > left_at + P + 1]
    assert len(after) >= 5, [r["round"] for r in rounds]
    assert all("learner-1" not in r["admitted"] for r in after)
    read_by = changes["learner-1"]["at"] + 5.0
    for r in s["rounds"]:
        decision = r.get("decided_at") or 0.0
        if decision > read_by:
            assert "learner-1" not in r["missing"], r
    assert s["learner_status"]["learner-1"] == "left"
    assert s["learner_status"]["learner-3"] == "done"
    assert s["learner_attempts"]["learner-1"] == 1   # never relaunched
    # The ledger balances exactly with the departed learner in it.
    ledger = s["ledger"]
    assert ledger["balanced"] and ledger["exact"], ledger["problems"]
    assert ledger["by_learner"]["learner-3"]["merged"] > 0
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.2
