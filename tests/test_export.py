"""`diloco export` and `load_exported`: the global model leaves the store as safetensors and
Orbax, comes back verified, and evaluates exactly as the store's own evaluation does."""

import json

import jax
import numpy as np
import pytest

from diloco_core.config_loading import config_to_mapping
from diloco_core.fragments import plan_fragments, split_params
from diloco_core.model import init_model
from diloco_core.outer import outer_optimizer_for
from pipelines.commands.cli import load_config, main
from pipelines.round_eval import evaluate_global
from resources.model_export import ExportError, export_global, load_exported
from resources.store.resource import ArtifactStoreResource

EVAL_BATCHES = 2


@pytest.fixture
def store(tmp_path):
    """An active tiny experiment whose fragment 1 has moved on to version 1 (a merge), so the
    export must pick each fragment's current version, not the initial model."""
    cfg = load_config(None, ["name=export-test", "model.preset=tiny", "sync.num_fragments=2",
                             "data.batch_size=4", "data.seq_len=32"])
    resource = ArtifactStoreResource(base_uri=str(tmp_path / "store"))
    artifacts = resource.store(cfg.name)
    artifacts.put_config(config_to_mapping(cfg))
    _, params = init_model(cfg.model, cfg.seed)
    plan = plan_fragments({k: v.shape for k, v in params.items()}, cfg.sync.num_fragments)
    tx = outer_optimizer_for(cfg)
    fragments = split_params(params, plan)
    for p, fragment in enumerate(fragments):
        artifacts.commit_global(p, 0, jax.device_get(fragment), tx.init(fragment),
                                {"round": None, "initial": True})
    moved = {k: np.asarray(v) * 0.5 + 0.01 for k, v in jax.device_get(fragments[1]).items()}
    artifacts.commit_global(1, 1, moved, tx.init(fragments[1]), {"round": 1})
    resource.set_active(cfg.name)
    return resource


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_an_export_reloads_with_the_same_parameters_and_held_out_loss(store, tmp_path, fmt):
    artifacts = store.active()
    manifest = export_global(artifacts, tmp_path / "out")
    assert [(f["fragment"], f["version"], f["round"]) for f in manifest["fragments"]] == \
        [(0, 0, None), (1, 1, 1)]
    model = load_exported(tmp_path / "out", fmt)
    for p in range(2):
        for name, value in artifacts.load_global(p).params.items():
            np.testing.assert_array_equal(np.asarray(model.params[name]), value)
    assert model.evaluate(EVAL_BATCHES)["loss"] == \
        evaluate_global(artifacts, EVAL_BATCHES).loss
    assert len(model.generate(b"def ", 8)) == 8


def test_the_cli_exports_the_active_experiment_and_never_overwrites(store, tmp_path, capsys):
    out = tmp_path / "cli-out"
    assert main(["export", "--store", store.base_uri, "--out", str(out)]) == 0
    assert "export-test" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"export.json", "config.json",
                                                "model.safetensors", "orbax"}
    assert main(["export", "--store", store.base_uri, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "never overwrites" in err and len(err.strip().splitlines()) == 1
    assert main(["export", "--store", str(tmp_path / "nothing"), "--out",
                 str(tmp_path / "x")]) == 2
    assert "no store at" in capsys.readouterr().err
    assert main(["export", "--store", store.base_uri, "--out", str(tmp_path / "y"),
                 "--format", "onnx"]) == 2
    assert "formats" in capsys.readouterr().err


def test_an_export_becomes_a_plain_nnx_module_in_three_lines(store, tmp_path):
    from flax import nnx

    from diloco_core.model import apply_model

    export_global(store.active(), tmp_path / "e", ("safetensors",))
    exported = load_exported(tmp_path / "e")
    model = exported.to_nnx()                       # the README's third line
    tokens = jax.numpy.arange(16, dtype=jax.numpy.int32).reshape(2, 8)
    logits, _ = model(tokens)
    assert isinstance(model, nnx.Module)
    np.testing.assert_array_equal(logits, apply_model(exported.model_def, exported.params,
                                                      tokens))


def test_every_exported_file_has_the_same_mode(store, tmp_path):
    """safetensors writes through a private temporary file: its model was left 0600 while the
    config beside it was 0644 (whoever could read one could not read the other)."""
    import os
    import stat

    out = tmp_path / "modes"
    previous = os.umask(0o022)
    try:
        export_global(store.active(), out, ("safetensors",))
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "export.json": 0o644}


def _tamper(out, what):
    if what == "no manifest":
        (out / "export.json").unlink()
    elif what == "flipped byte":
        data = bytearray((out / "model.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (out / "model.safetensors").write_bytes(bytes(data))
    elif what == "resigned foreign tensor":
        # A hostile file whose checksum is rewritten to vouch for it: the model's own shapes
        # still refuse it.
        from safetensors.numpy import save_file

        from resources.store.array_bundle import sha256

        save_file({"w": np.zeros((3, 3), np.float32)}, str(out / "model.safetensors"))
        manifest = json.loads((out / "export.json").read_text())
        manifest["sha256"]["model.safetensors"] = sha256((out / "model.safetensors")
                                                         .read_bytes())
        (out / "export.json").write_text(json.dumps(manifest))
    elif what == "not json":
        (out / "export.json").write_text("{")


@pytest.mark.parametrize("what, reason", [
    ("no manifest", "no export.json"),
    ("flipped byte", "checksum mismatch"),
    ("resigned foreign tensor", "do not match the model"),
    ("not json", "not JSON"),
])
def test_a_damaged_export_is_refused_with_the_reason(store, tmp_path, what, reason):
    out = tmp_path / "out"
    export_global(store.active(), out, ("safetensors",))
    _tamper(out, what)
    with pytest.raises(ExportError, match=reason):
        load_exported(out)


def test_a_format_the_export_does_not_hold_is_refused(store, tmp_path):
    export_global(store.active(), tmp_path / "out", ("safetensors",))
    with pytest.raises(ExportError, match="this export has"):
        load_exported(tmp_path / "out", "orbax")
