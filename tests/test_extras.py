"""A laptop install without the extras: the definitions load and the local path works, and a
feature that needs an extra says which one in one line.

An extra's absence cannot be produced in the suite's own environment (it installs them all),
so these tests hide the extra's modules from the import system (`sys.modules[name] = None`
makes `import name` fail as if it were not installed).
"""

import json
import subprocess
import sys

import pytest

from pipelines.commands.cli import main
from resources.extras import MissingExtra

GCP = ("google.cloud", "google_crc32c", "gcsfs", "dagster_gcp")
K8S = ("dagster_k8s", "kubernetes")
POSTGRES = ("dagster_postgres", "psycopg2")
DIGITS = ("sklearn",)
PLOTS = ("matplotlib",)


def _hide(monkeypatch, modules) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_the_definitions_load_and_a_local_store_works_without_any_extra(tmp_path):
    hidden = [*GCP, *K8S, *POSTGRES, *DIGITS, *PLOTS]
    # Not installed means no modules and no plugin registrations: Dagster loads every
    # installed package's `dagster_dg_cli.registry_modules` entry point.
    script = f"""
import importlib.metadata, json, sys
hidden = {hidden!r}
for name in hidden:
    sys.modules[name] = None
_entry_points = importlib.metadata.entry_points
importlib.metadata.entry_points = lambda **kw: [
    e for e in _entry_points(**kw) if not e.value.split(".")[0].split(":")[0] in hidden]
from pipelines.definitions import defs
from resources.store.resource import ArtifactStoreResource
loaded = defs()
store = ArtifactStoreResource(base_uri={str(tmp_path / 'store')!r}).store("lean")
store.put_config({{"name": "lean"}})
leaked = sorted(m for m in {hidden!r} if sys.modules.get(m) is not None)
print(json.dumps({{"jobs": sorted(j.name for j in loaded.jobs), "leaked": leaked,
                   "config": store.get_config()}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"train", "learner", "syncer", "merge_round", "stop"} <= set(result["jobs"])
    assert result["config"] == {"name": "lean"} and result["leaked"] == []


def test_a_gs_store_without_the_gcp_extra_names_it(monkeypatch, capsys):
    from resources.store.backends import open_blob_store

    _hide(monkeypatch, GCP)
    with pytest.raises(MissingExtra, match=r"pip install 'decoupled-diloco\[gcp\]'"):
        open_blob_store("gs://bucket/prefix")
    assert main(["status", "--store", "gs://bucket/prefix"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'gcp' extra" in err


def test_postgres_manifests_and_digits_name_their_extras(monkeypatch, capsys, tmp_path):
    from pipelines.commands.dagster_dev import check_postgres_url
    from resources.digits import load_digits_examples

    _hide(monkeypatch, [*POSTGRES, *K8S, *DIGITS])
    with pytest.raises(MissingExtra, match="'postgres' extra"):
        check_postgres_url("postgresql://u@localhost:5432/db")
    with pytest.raises(MissingExtra, match="'digits' extra"):
        load_digits_examples()
    deployment = tmp_path / "deploy.yaml"
    deployment.write_text("regions: {}\n")
    assert main(["manifests", "--deployment", str(deployment)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'k8s' extra" in err


def test_without_the_plots_extra_commands_and_the_goodput_asset_give_figures_and_no_plot(
        monkeypatch, capsys, tmp_path):
    """matplotlib (~75 MiB with its fonts) is the `plots` extra: without it `diloco bandwidth`
    prints its plan and one line naming the extra, and the goodput asset records its table."""
    import dagster as dg

    from pipelines.defs.goodput import goodput_at_scale

    _hide(monkeypatch, PLOTS)
    plot = tmp_path / "bw.png"
    assert main(["bandwidth", "--params", "1e9", "--sites", "4", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    assert "decoupled" in captured.out and not plot.exists()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("no plot: ") and "pip install 'decoupled-diloco[plots]'" in line
    result = dg.materialize([goodput_at_scale], run_config={"ops": {"goodput_at_scale": {
        "config": {"seeds": 2, "plot_path": str(tmp_path / "g.png")}}}})
    assert result.success
    (mat,) = result.asset_materializations_for_node("goodput_at_scale")
    assert "| 1,200,128 |" in mat.metadata["table"].value and "plot" not in mat.metadata
    assert not (tmp_path / "g.png").exists()
