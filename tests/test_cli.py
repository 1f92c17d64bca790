import contextlib
import json
from pathlib import Path

import pytest

from pipelines.commands.cli import main

TINY = ["--set", "model.preset=tiny", "--set", "data.seq_len=32", "--set", "data.batch_size=4",
        "--set", "learners.num_learners=2", "--set", "sync.num_fragments=2",
        "--set", "sync.sync_period=4", "--set", "token_budget=2048",
        "--set", "simulation.eval_batches=1"]


def test_bad_config_is_refused_before_anything_runs(capsys, tmp_path):
    code = main(["simulate", "--set", "sync.min_quorum=9", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "sync.min_quorum" in err and "<= learners.num_learners (4)" in err
    assert not any(tmp_path.iterdir()), "nothing may be written for a bad config"
    assert main(["config", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_bad_fault_tape_is_refused_before_dagster_starts(capsys, tmp_path):
    tape = tmp_path / "tape.json"
    tape.write_text(json.dumps({"faults": [
        {"id": "k", "kind": "learner_kill", "learner": "learner-9", "at_step": 3}]}))
    workdir = tmp_path / "demo"
    code = main(["demo", "--fault-tape", str(tape), "--workdir", str(workdir)])
    assert code == 2
    err = capsys.readouterr().err
    assert "faults[0].learner" in err and "'learner-9' is not a learner" in err
    assert not workdir.exists(), "nothing may be started or written for a bad tape"
    assert main(["demo", "--fault-tape", str(tmp_path / "missing.json")]) == 2
    assert "invalid fault tape: cannot read" in capsys.readouterr().err


def test_config_prints_every_default_and_reads_files(capsys, tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text('name = "from-toml"\n[sync]\nmin_quorum = 2\n')
    assert main(["config", "--config", str(path), "--set", "sync.encoding=int4"]) == 0
    out = capsys.readouterr().out
    assert "name: from-toml" in out and "min_quorum: 2" in out and "encoding: int4" in out
    assert "grace_gamma: 0.8" in out


def test_params_counts_presets(capsys):
    assert main(["params", "--preset", "tiny", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["parameters"] == 37_024 and row["fp32_bytes"] == 4 * 37_024
    assert main(["params"]) == 0       # the table: one column per figure, however long a name
    lines = capsys.readouterr().out.splitlines()
    assert len({line.index(" M params") for line in lines}) == 1, lines


def test_simulate_writes_results_and_plot(capsys, tmp_path):
    code = main(["simulate", *TINY, "--baselines", "data_parallel", "--out", str(tmp_path),
                 "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    methods = [row["method"] for row in printed["table"]]
    assert methods == ["decoupled_diloco", "data_parallel"]
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["machine"]["cpu_count"] >= 1 and record["machine"]["processor"]
    assert record["config"]["token_budget"] == 2048
    assert (tmp_path / "heldout_loss.png").stat().st_size > 1000


def test_bandwidth_plan(capsys, tmp_path):
    code = main(["bandwidth", "--params", "1e9", "--sites", "4", "--sync-period", "8",
                 "--fragments", "4", "--overlap", "1", "--available-gbps", "10", "--json",
                 "--plot", str(tmp_path / "bw.png")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    plans = {p["method"]: p for p in out["plans"]}
    assert abs(plans["data_parallel"]["average_gbps"] - 24.0) < 1e-9
    assert plans["decoupled_diloco"]["utilisation"] == 1.0
    assert (tmp_path / "bw.png").stat().st_size > 1000


def test_goodput_json(capsys, tmp_path):
    code = main(["goodput", "--chips", "150016", "--learners", "8", "--seeds", "2", "--json",
                 "--plot", str(tmp_path / "g.png")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("data_parallel", "data_parallel_elastic", "decoupled", "decoupled_uptime"):
        assert 0.0 <= out[key] <= 1.0
    assert out["decoupled"] > out["data_parallel"]
    assert (tmp_path / "g.png").stat().st_size > 1000


@pytest.mark.parametrize("overrides, message", [
    (["task=digits", "model.preset=vit-digits"],
     "task: 'digits' runs on the in-process simulator only"),
    (["learners.warm_start_fraction=0.25"],
     "learners.warm_start_fraction: runs on the in-process simulator only"),
])
def test_demo_refuses_what_only_the_simulator_runs(capsys, tmp_path, overrides, message):
    workdir = tmp_path / "demo"
    code = main(["demo", *(a for o in overrides for a in ("--set", o)),
                 "--workdir", str(workdir)])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not workdir.exists()


def test_simulate_the_digits_task_reports_accuracy(capsys, tmp_path):
    digits = ["--set", "task=digits", "--set", "model.preset=vit-digits",
              "--set", "model.n_layers=1", "--set", "data.batch_size=8",
              "--set", "learners.num_learners=2", "--set", "sync.num_fragments=2",
              "--set", "sync.sync_period=4", "--set", "token_budget=320"]
    assert main(["simulate", *digits, "--baselines", "data_parallel", "--out", str(tmp_path),
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["table"]
    assert [r["method"] for r in rows] == ["decoupled_diloco", "data_parallel"]
    assert all(0.0 <= r["accuracy"] <= 1.0 and "bits_per_byte" not in r for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["goodput", "--chips", "0"], "argument --chips: must be >= 256"),
    (["goodput", "--chips", "100"], "argument --chips: must be >= 256"),
    (["goodput", "--chips", "256", "--mtbi-years", "-1"], "--mtbi-years: must be > 0"),
    (["goodput", "--chips", "256", "--seeds", "0"], "--seeds: must be >= 1"),
    (["bandwidth", "--sites", "0"], "--sites: must be >= 1"),
    (["bandwidth", "--params", "0"], "--params: must be > 0"),
    (["bandwidth", "--fragments", "48", "--plot", ""], "multiple of num_fragments"),
    (["goodput", "--chips", "-5"], "argument --chips: must be >= 256, got -5"),
    (["goodput", "--chips", "256", "--learners", "0"], "argument --learners: must be >= 1"),
    (["config", "--set", "learners.num_learners=100000000"],
     "learners.num_learners: must be an integer in [1, 4096]"),
    (["config", "--set", "token_budget=99999999999999999999"], "token_budget: must be"),
    (["config", "--set", "data.batch_size=1000000000"], "data.batch_size: must be"),
])
def test_bad_arguments_get_one_line_errors_not_tracebacks(argv, message, capsys):
    with contextlib.suppress(SystemExit):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_empty_plot_path_writes_no_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bandwidth", "--plot", ""]) == 0
    assert "decoupled_diloco" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []            # no ./.png, no runs/ directory


def test_a_config_file_with_a_syntax_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    assert main(["config", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    toml = tmp_path / "bad.toml"
    toml.write_text("a = \n")
    assert main(["config", "--config", str(toml)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("diloco ")


def test_changing_the_number_of_learners_drops_the_launch_defaults_per_learner_lists():
    from pipelines.commands.config_layers import load_config
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS

    assert len(load_config(None, [], base=ORCHESTRATED_DEFAULTS).learners.learner_speeds) == 4
    cfg = load_config(None, ["learners.num_learners=2"], base=ORCHESTRATED_DEFAULTS)
    assert cfg.learners.learner_speeds == (1.0, 1.0)
    cfg = load_config(None, ["learners.num_learners=2", "learners.speeds=[1.0, 0.5]"],
                      base=ORCHESTRATED_DEFAULTS)
    assert cfg.learners.learner_speeds == (1.0, 0.5)


def test_one_learner_is_not_refused_for_a_quorum_the_user_never_set():
    from diloco_core.config import ConfigError
    from pipelines.commands.config_layers import load_config
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS

    cfg = load_config(None, ["learners.num_learners=1"], base=ORCHESTRATED_DEFAULTS)
    assert cfg.learners.num_learners == 1 and cfg.sync.min_quorum == 1
    assert load_config(None, ["learners.num_learners=3"],
                       base=ORCHESTRATED_DEFAULTS).sync.min_quorum == 2    # K <= M: kept
    with pytest.raises(ConfigError, match="min_quorum"):       # a K the user set is checked
        load_config(None, ["learners.num_learners=1", "sync.min_quorum=2"],
                    base=ORCHESTRATED_DEFAULTS)


def test_config_orchestrated_shows_what_demo_and_train_run(capsys):
    import yaml

    from pipelines.commands.config_layers import load_config
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS

    assert main(["config", "--orchestrated", "--set", "sync.min_quorum=1"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    expected = load_config(None, ["sync.min_quorum=1"], base=ORCHESTRATED_DEFAULTS)
    assert shown["sync"]["sync_period"] == expected.sync.sync_period
    assert shown["learners"]["num_learners"] == expected.learners.num_learners
    assert shown["sync"]["min_quorum"] == 1
    assert main(["config"]) == 0
    plain = yaml.safe_load(capsys.readouterr().out)
    assert plain != shown


def test_orchestrated_runs_rebase_on_receipt_and_the_chaos_soak_measures_that_rule():
    """A late merge (a syncer relaunch) must not overwrite what a learner trained since its
    offer in orchestrated runs (the experiments' default too since issue 38). The soak has its
    own config, so it must follow the launch defaults' rule or it measures another product."""
    from benchmarks.chaos_soak import configs
    from pipelines.commands.config_layers import load_config
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS

    assert load_config(None, [], base=ORCHESTRATED_DEFAULTS).sync.receive_rule == "rebase"
    assert load_config(None, []).sync.receive_rule == "rebase"
    soak = configs(600_000)
    assert soak["decoupled"].sync.receive_rule == "rebase"
    # Synchronous DiLoCo's learners block at each sync: nothing to keep, the paper's rule.
    assert soak["synchronous"].sync.receive_rule == "overwrite"


def test_status_of_a_bucket_without_credentials_is_one_line(tmp_path):
    """No Application Default Credentials (and no metadata server to fall back on): one line
    naming the store and the reason, exit status 2, no traceback."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST",
                        "CLOUDSDK_CONFIG")}
    env.update(HOME=str(tmp_path), GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9")
    out = subprocess.run([sys.executable, "-m", "pipelines.commands.cli", "status", "--store",
                          "gs://no-such-bucket/diloco"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "cannot read the store gs://no-such-bucket/diloco" in out.stderr
    assert "DefaultCredentialsError" in out.stderr
