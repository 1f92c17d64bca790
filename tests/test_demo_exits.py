"""`diloco demo` around the run itself, with Dagster replaced by a stand-in (fast): each demo is
its own experiment and prints the commands that reach it; Ctrl-C is one line saying how to
resume; a finished workdir says so; a workdir that cannot be used, or that another demo
holds, is one line naming the path."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.commands import demo as demo_command
from pipelines.commands.cli import main

FAST = ["--set", "model.preset=tiny"]


@pytest.fixture
def launched(monkeypatch):
    """Stops `run_demo` at its call: what it would have run."""
    calls = []

    def fake_run_demo(cfg, **kw):
        calls.append({"cfg": cfg, **kw})
        return 0

    monkeypatch.setattr(demo_command, "run_demo", fake_run_demo)
    return calls


def test_each_demo_is_its_own_experiment_and_a_workdir_resumes_its_own(tmp_path, monkeypatch,
                                                                      launched):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", *FAST]) == 0
    first = launched[-1]
    assert first["cfg"].name.startswith("diloco-demo-")
    stamp = first["cfg"].name.removeprefix("diloco-demo-")
    assert first["workdir"] == f"runs/demo-{stamp}"       # the workdir and the name agree
    # The workdir of an earlier demo keeps its experiment, so running there resumes it.
    old = tmp_path / "old"
    old.mkdir()
    (old / "experiment.yaml").write_text(yaml.safe_dump({"name": "diloco-demo-earlier"}))
    assert main(["demo", *FAST, "--workdir", str(old)]) == 0
    assert launched[-1]["cfg"].name == "diloco-demo-earlier"
    # A name the user gives wins.
    assert main(["demo", *FAST, "--set", "name=mine", "--workdir", str(old)]) == 0
    assert launched[-1]["cfg"].name == "mine"
    # The resume command repeats the options, with the workdir made absolute.
    assert launched[-1]["resume_command"] == (
        f"diloco demo --set model.preset=tiny --set name=mine --workdir {old.resolve()}")


class FakeDev:
    """DagsterDev's interface; `on_enter` runs as the instance 'starts', `on_submit` as the
    train job is launched."""

    on_enter = on_submit = None
    exits: list = []
    in_flight: list = []     # what each `runs_in_flight` answers in turn ([] once empty)
    events: list = []

    def __init__(self, home, **kw):
        self.home = Path(home)
        self.url, self.log_path, self.restarts = "http://127.0.0.1:1", self.home / "log", []

    def __enter__(self):
        if FakeDev.on_enter:
            FakeDev.on_enter()
        return self

    def __exit__(self, exc_type, *exc):
        FakeDev.exits.append(exc_type)
        FakeDev.events.append("stopped")

    def runs_in_flight(self):
        runs = FakeDev.in_flight.pop(0) if FakeDev.in_flight else []
        FakeDev.events.append(runs)
        return runs

    def submit_job(self, *a, **kw):
        if FakeDev.on_submit:
            FakeDev.on_submit()
        return "run-1"


@pytest.fixture
def fake_dagster(monkeypatch):
    FakeDev.on_enter, FakeDev.on_submit, FakeDev.exits = None, None, []
    FakeDev.in_flight, FakeDev.events = [], []
    monkeypatch.setattr(demo_command, "DagsterDev", FakeDev)
    return FakeDev


def test_ctrl_c_is_one_line_saying_how_to_resume(tmp_path, fake_dagster, capsys):
    fake_dagster.on_submit = lambda: os.kill(os.getpid(), signal.SIGINT)
    workdir = tmp_path / "demo"
    previous = signal.getsignal(signal.SIGINT)
    try:
        code = main(["demo", *FAST, "--workdir", str(workdir), "--timeout", "5"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped from the demo (a traceback for the user)")
    assert code == 130
    err = capsys.readouterr().err.strip()
    assert err == ("demo: interrupted; resume this run with: diloco demo --set "
                   f"model.preset=tiny --timeout 5 --workdir {workdir.resolve()}")
    assert fake_dagster.exits == [KeyboardInterrupt]       # the instance was stopped
    assert signal.getsignal(signal.SIGINT) is previous     # Ctrl-C is the user's again


def test_the_instance_gets_a_short_grace_on_ctrl_c(tmp_path):
    from pipelines.commands.dagster_dev import DagsterDev

    graces = []
    dev = DagsterDev(tmp_path / "home")
    dev.stop = lambda grace=30.0: graces.append(grace)
    dev.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    dev.__exit__(None, None, None)
    assert graces[0] <= 10 and graces[1] == 30.0


def test_a_finished_workdir_says_it_is_finished_and_starts_nothing(tmp_path, fake_dagster,
                                                                   capsys):
    from diloco_core.config_loading import config_to_mapping
    from pipelines.commands.cli import load_config
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store
    from resources.store.summary_records import RunOutcome, RunSummary

    workdir = tmp_path / "demo"
    cfg = load_config(None, ["name=done-demo", "model.preset=tiny"], base=ORCHESTRATED_DEFAULTS)
    store = ArtifactStore(open_blob_store(str(workdir / "store")), cfg.name)
    store.put_config(config_to_mapping(cfg))
    store.mark_finished({"at": time.mktime((2026, 11, 20, 9, 30, 0, 0, 0, -1)), "by": "syncer-a0",
                        "last_round": 61})
    store.put_summary(RunSummary(outcome=RunOutcome(rounds_merged=62, initial_eval_loss=5.56,
                                                    final_eval_loss=1.73)))
    (workdir / "experiment.yaml").write_text(yaml.safe_dump(config_to_mapping(cfg)))

    def started():
        raise AssertionError("Dagster must not start for a finished run")

    fake_dagster.on_enter = started
    assert main(["demo", *FAST, "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "already finished (2026-11-20 09:30)" in out and "done-demo" in out
    assert "62 rounds merged" in out and "diloco status --store" in out
    assert "diloco stop" not in out and "wall time" not in out


def _summary_recorded_on_submit(workdir: Path):
    """As the `summarize` run would: the summary in the store, recorded as Dagster's asset."""
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store
    from resources.store.summary_records import RunOutcome, RunSummary

    def submit():
        name = yaml.safe_load((workdir / "experiment.yaml").read_text())["name"]
        store = ArtifactStore(open_blob_store(str(workdir / "store")), name)
        store.put_summary(RunSummary(outcome=RunOutcome(rounds_merged=3),
                                     summarized_by=ArtifactStore.SUMMARY_RECORDED_BY))
    return submit


def test_dagster_is_stopped_only_once_its_runs_have_ended(tmp_path, fake_dagster, capsys,
                                                          monkeypatch):
    """The `summarize` run records the summary a moment before it returns: the demo waits
    for the runs in flight to end before it stops the instance, which would otherwise end
    them as failed runs in its history; runs that do not end in time are named."""
    workdir = tmp_path / "demo"
    fake_dagster.on_submit = _summary_recorded_on_submit(workdir)
    fake_dagster.in_flight = [["summarize (1234abcd)"], ["summarize (1234abcd)"]]
    assert main(["demo", *FAST, "--workdir", str(workdir), "--timeout", "60"]) == 0
    assert fake_dagster.events == [["summarize (1234abcd)"]] * 2 + [[], "stopped"]
    assert "still in flight" not in capsys.readouterr().err

    monkeypatch.setattr(demo_command, "RUNS_END_SECONDS", 1.0)
    workdir = tmp_path / "demo2"
    fake_dagster.on_submit = _summary_recorded_on_submit(workdir)
    fake_dagster.in_flight, fake_dagster.events = [["learner (5678abcd)"]] * 100, []
    assert main(["demo", *FAST, "--workdir", str(workdir), "--timeout", "60"]) == 0
    assert fake_dagster.events[-1] == "stopped"
    assert ("demo: stopping Dagster with runs still in flight: learner (5678abcd)"
            in capsys.readouterr().err)


def test_the_demo_prints_the_store_experiment_and_commands(tmp_path, fake_dagster, capsys):
    workdir = tmp_path / "demo"
    assert main(["demo", *FAST, "--set", "learners.num_learners=1", "--workdir", str(workdir),
                 "--timeout", "0.1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("demo: 1 learner, budget")
    name = yaml.safe_load((workdir / "experiment.yaml").read_text())["name"]
    store = workdir.resolve() / "store"
    assert f"experiment {name} in the store {store}" in out
    assert f"diloco status --store {store} --experiment {name}" in out
    assert f"diloco stop --store {store} --experiment {name}" in out


def _read_only_below(monkeypatch, top: Path):
    """Creating anything under `top` fails as on a read-only file system (the tests run as
    root, which a chmod does not stop)."""
    real = Path.mkdir

    def mkdir(self, *a, **kw):
        if top in self.resolve().parents or self.resolve() == top:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)


def test_a_workdir_that_is_a_file_is_one_line(tmp_path, fake_dagster, capsys):
    workdir = tmp_path / "demo"
    workdir.write_text("x")
    assert main(["demo", *FAST, "--workdir", str(workdir)]) == 2
    assert capsys.readouterr().err == (f"diloco demo: cannot use {workdir} as the workdir: it "
                                       "is a file, not a directory\n")


def test_a_read_only_workdir_is_one_line(tmp_path, fake_dagster, capsys, monkeypatch):
    _read_only_below(monkeypatch, tmp_path / "ro")
    workdir = tmp_path / "ro" / "demo"
    assert main(["demo", *FAST, "--workdir", str(workdir)]) == 2
    assert capsys.readouterr().err == (f"diloco demo: cannot create the workdir {workdir}: "
                                       "Read-only file system\n")


def test_a_workdir_another_demo_holds_is_refused(tmp_path, fake_dagster, capsys):
    from pipelines.commands.workdir import held

    workdir = tmp_path / "demo"
    workdir.mkdir()
    # The holder is another process (an flock is per open file, so a second open in this
    # process would be refused too, but the point is another demo).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from pipelines.commands.workdir import held\n"
         f"with held(Path({str(workdir)!r})):\n    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["demo", *FAST, "--workdir", str(workdir), "--timeout", "1"]) == 2
        err = capsys.readouterr().err
        assert err.strip() == (f"diloco demo: the workdir {workdir.resolve()} is in use by "
                               f"another demo (pid {holder.pid}); watch that run with "
                               "`diloco status`, or give another --workdir")
    finally:
        holder.kill()
        holder.wait()
    with held(workdir):        # released when its holder died, however it died
        pass


def test_export_to_a_read_only_place_is_one_line(tmp_path, capsys, monkeypatch):
    from resources import model_export

    def export_global(store, out, formats):   # the real one, up to where it writes
        Path(out).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(model_export, "export_global", export_global)
    from test_run_address import _experiment

    _experiment(tmp_path / "store", "exp", active=True)
    _read_only_below(monkeypatch, tmp_path / "ro")
    out = tmp_path / "ro" / "x"
    code = main(["export", "--store", str(tmp_path / "store"), "--out", str(out)])
    assert code != 0
    assert capsys.readouterr().err == f"diloco export: cannot use {out}: Read-only file system\n"


def _report(stopped_early=None, **timing):
    from resources.store.summary_records import (
        LearnerAccount,
        RunOutcome,
        RunSummary,
        RunTiming,
    )

    summary = RunSummary(
        outcome=RunOutcome(rounds_merged=3, rounds_opened=5, initial_eval_loss=5.5,
                           final_eval_loss=4.0, final_bits_per_byte=5.0, tokens=10,
                           token_budget=100, final_sample="x"),
        timing=RunTiming(uptime=1.0, **timing),
        learners=LearnerAccount(learner_idle_fraction=0.0))
    return demo_command.DemoReport(summary=summary, wall_seconds=9.0,
                                   watch=demo_command.Watch(), workdir="w",
                                   stopped_early=stopped_early)


def test_the_summary_says_when_and_why_a_run_was_stopped_early(capsys):
    demo_command._print_summary(_report())
    assert "stopped early" not in capsys.readouterr().out
    at = time.mktime((2026, 11, 20, 9, 30, 5, 0, 0, -1))
    demo_command._print_summary(_report(stopped_early={
        "requested_by": "ana (diloco stop)", "reason": "capacity reclaimed", "time": at}))
    assert ("stopped early        at 09:30:05, requested by ana (diloco stop): capacity "
            "reclaimed") in capsys.readouterr().out


def test_the_summary_says_who_decided_and_merged_the_rounds(capsys):
    by = {"syncer-a0": 1, "syncer-a0-standby": 1, "syncer-a1": 1}
    demo_command._print_summary(_report(decided_by=by, merged_by=by))
    out = capsys.readouterr().out
    assert "decided by           syncer-a0 1, syncer-a0-standby 1, syncer-a1 1" in out


def test_the_ctrl_c_line_is_set_up_only_from_the_main_thread():
    import threading

    errors = []

    def drive():
        try:
            with demo_command._interrupt_says("x"):
                pass
        except ValueError as err:        # signal.signal outside the main thread
            errors.append(err)

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    assert errors == []
