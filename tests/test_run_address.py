"""One address for a run: `status`, `list`, `stop` and `export` find the store (the most recent
under runs/ when none is given) and the experiment (the active one, else the only one), a
finished run is still found and shown as finished, and reading never creates directories."""

import json
import os
import time

import pytest

from diloco_core.config_loading import config_to_mapping
from pipelines.commands.cli import load_config, main
from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
from pipelines.run_address import most_recent_store
from resources.store.artifact_store import ArtifactStore, set_active_experiment
from resources.store.backends import open_blob_store
from resources.store.summary_records import RunOutcome, RunSummary


def _experiment(store_dir, name, *, active=False, finished=False, operator_stop=False):
    blobs = open_blob_store(str(store_dir))
    store = ArtifactStore(blobs, name)
    cfg = load_config(None, [f"name={name}"], base=ORCHESTRATED_DEFAULTS)
    store.put_config(config_to_mapping(cfg))
    if operator_stop:
        store.put_stop_request({"requested_by": "test", "reason": "", "time": time.time()})
    if finished:
        store.request_stop({"reason": "token budget", "time": time.time()})
        store.mark_finished({"at": time.time(), "by": "test", "last_round": 6})
        store.put_summary(RunSummary(outcome=RunOutcome(
            rounds_merged=7, initial_eval_loss=5.5, final_eval_loss=2.25)))
    if active:
        set_active_experiment(blobs, name)
    return store


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_status_finds_a_finished_experiment_without_a_name_and_says_it_finished(tmp_path,
                                                                                capsys):
    _experiment(tmp_path / "store", "diloco-demo-1", finished=True)   # ACTIVE cleared
    assert main(["status", "--store", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert "diloco-demo-1" in out and "finished" in out and "open" not in out
    assert main(["status", "--store", str(tmp_path / "store"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "finished"


def test_a_store_of_several_inactive_experiments_asks_for_one_by_name(tmp_path, capsys):
    _experiment(tmp_path / "store", "first", finished=True)
    _experiment(tmp_path / "store", "second")
    assert main(["status", "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert "first, second" in err and "--experiment" in err and len(err.splitlines()) == 1
    assert main(["status", "--store", str(tmp_path / "store"), "--experiment", "third"]) == 2
    assert "no experiment 'third'" in capsys.readouterr().err
    assert main(["status", "--store", str(tmp_path / "store"), "--experiment", "first"]) == 0


def test_list_shows_every_experiment_with_its_state(tmp_path, capsys):
    store = tmp_path / "store"
    _experiment(store, "done", finished=True)
    _experiment(store, "halted", finished=True, operator_stop=True)
    _experiment(store, "interrupted")
    _experiment(store, "diloco-demo-20261126-001019", active=True)
    (store / "experiments" / "half-made").mkdir()          # no config yet: not listed
    assert main(["list", "--store", str(store), "--json"]) == 0
    rows = {r["experiment"]: r for r in json.loads(capsys.readouterr().out)}
    assert {k: r["state"] for k, r in rows.items()} == {
        "done": "finished", "halted": "stopped", "interrupted": "inactive",
        "diloco-demo-20261126-001019": "active"}
    assert rows["done"]["rounds_merged"] == 7
    assert main(["list", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "halted" in out and "diloco-demo-20261126-001019" in out    # never cut to fit


def test_read_only_commands_never_create_directories(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DILOCO_STORE_URI", raising=False)
    typo = tmp_path / "stroe"
    for command in ("status", "list", "stop", "export"):
        extra = ["--out", str(tmp_path / "x")] if command == "export" else []
        assert main([command, "--store", str(typo), *extra]) == 2
        err = capsys.readouterr().err
        assert err.strip() == f"diloco {command}: no store at {typo}: no such directory"
        assert main([command, *extra]) == 2                 # nothing under runs/ either
        assert "no store found under" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []                  # no store, no runs/, no export
    store = tmp_path / "store"
    _experiment(store, "exp", active=True)
    before = _tree(store)
    assert main(["status", "--store", str(store)]) == 0
    assert main(["list", "--store", str(store)]) == 0
    assert _tree(store) == before


def test_without_a_store_the_most_recent_under_runs_is_used(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DILOCO_STORE_URI", raising=False)
    old = _experiment(tmp_path / "runs" / "demo-1" / "store", "old-demo", finished=True)
    _experiment(tmp_path / "runs" / "demo-2" / "store", "new-demo", active=True)
    stamp = time.time() - 3600                              # demo-1 was written an hour ago
    for path in (tmp_path / "runs" / "demo-1").rglob("*"):
        os.utime(path, (stamp, stamp))
    os.utime(tmp_path / "runs" / "demo-1" / "store", (stamp, stamp))
    assert most_recent_store(tmp_path / "runs").name == "store"
    assert most_recent_store(tmp_path / "runs").parent.name == "demo-2"
    assert main(["status"]) == 0
    captured = capsys.readouterr()
    assert "new-demo" in captured.out
    assert "most recent under runs/" in captured.err and "demo-2" in captured.err
    # The old one is still reachable by name, and stop on it (finished) says so.
    assert main(["stop", "--store", old.blobs.uri]) == 0
    assert "already finished" in capsys.readouterr().out
    # $DILOCO_STORE_URI beats the search.
    monkeypatch.setenv("DILOCO_STORE_URI", old.blobs.uri)
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["experiment"] == "old-demo"


@pytest.mark.parametrize("state", ["active", "finished"])
def test_export_finds_the_only_experiment(tmp_path, capsys, state):
    """Export resolves the experiment as status does (it then fails for want of parameters in
    this bare store: the point is that it got that far)."""
    _experiment(tmp_path / "store", "only", active=state == "active",
                finished=state == "finished")
    code = main(["export", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "no active experiment" not in err and "fragment 0" in err


def test_list_on_a_gcs_store_reads_only_the_experiment_level(gcs_server, capsys):
    """On GCS the experiments come from one delimiter listing (not every object under them)."""
    import uuid

    from gcs_emulator import BUCKET

    uri = f"gs://{BUCKET}/catalog-{uuid.uuid4().hex[:8]}"
    _experiment(uri, "one", finished=True)
    _experiment(uri, "two", active=True)
    open_blob_store(uri).write("experiments/no-config/rounds/OPEN", b"{}")
    assert main(["list", "--store", uri, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["experiment"], r["state"]) for r in rows] == [("one", "finished"),
                                                            ("two", "active")]
