"""Export the global model of an experiment, and load an export back from Python.

An export is a directory other tools can read without this project's store:

- `model.safetensors`: every parameter under its flat name (`blocks/0/attn/q/kernel`, ...), for
  the wider ecosystem (safetensors never executes code on load);
- `orbax/`: the same flat dict as an Orbax checkpoint, for JAX users;
- `config.json`: the experiment's validated config, enough to rebuild the model;
- `export.json`, written last, the commit point: the experiment, the version and round of every
  fragment it holds, the parameter count, and the SHA-256 of `model.safetensors`. A directory
  without it is an export that did not finish and is refused.

Loading treats the files as untrusted: the checksum must match, and every name, shape and dtype
must be the model's, as rebuilt from the config, before any array is used.
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_from_mapping
from diloco_core.evaluation import evaluate, generate
from diloco_core.model import FlatParams, ModelDef, abstract_params, make_model_def
from resources.store.array_bundle import sha256
from resources.store.artifact_store import ArtifactStore
from resources.task_data import heldout_text_batches

FORMATS = ("safetensors", "orbax")
EXPORT_FORMAT_VERSION = 1
MANIFEST = "export.json"
SAFETENSORS = "model.safetensors"
ORBAX = "orbax"
CONFIG = "config.json"


class ExportError(ValueError):
    """An export that cannot be written or read, with the reason."""


def export_global(store: ArtifactStore, out_dir: str | os.PathLike,
                  formats: tuple[str, ...] = FORMATS) -> dict:
    """Write the current global parameters of `store`'s experiment to `out_dir` (which must not
    exist or be empty: an export never replaces files). Returns the manifest."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ExportError(f"formats: {unknown or 'none'} (choose from {', '.join(FORMATS)})")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory (an export never "
                          "overwrites; choose a new path)")
    mapping = store.get_config()
    if mapping is None:
        raise ExportError(f"experiment {store.experiment!r} has no config in the store")
    cfg = config_from_mapping(mapping)
    params: dict[str, np.ndarray] = {}
    fragments = []
    for p in range(cfg.sync.num_fragments):
        try:
            fragment = store.load_global(p)
        except KeyError as err:
            raise ExportError(f"fragment {p}: {err.args[0]}") from None
        params.update({k: np.asarray(v) for k, v in fragment.params.items()})
        fragments.append({"fragment": p, "version": fragment.version,
                          "round": fragment.meta.round})
    _check_params(cfg, params, "the store")

    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(mapping, indent=2, sort_keys=True))
    files = {CONFIG: sha256((out / CONFIG).read_bytes())}
    if "safetensors" in formats:
        from safetensors.numpy import save_file

        save_file(params, str(out / SAFETENSORS),
                  metadata={"experiment": store.experiment, "format": "decoupled-diloco"})
        # safetensors writes through a private temporary file (mode 0600): give the export
        # the mode its other files got from the umask, so whoever may read one reads all.
        os.chmod(out / SAFETENSORS, (out / CONFIG).stat().st_mode & 0o777)
        files[SAFETENSORS] = sha256((out / SAFETENSORS).read_bytes())
    if "orbax" in formats:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save((out / ORBAX).absolute(), params)
            checkpointer.wait_until_finished()
    manifest = {
        "format_version": EXPORT_FORMAT_VERSION, "experiment": store.experiment,
        "formats": list(formats), "fragments": fragments,
        "num_params": int(sum(v.size for v in params.values())), "sha256": files,
    }
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(out / MANIFEST)             # the commit point: written whole, last
    return manifest


@dataclass(frozen=True)
class ExportedModel:
    """A loaded export: the config, the model definition and its flat parameters."""

    cfg: ExperimentConfig
    model_def: ModelDef
    params: FlatParams
    manifest: dict

    def evaluate(self, num_batches: int | None = None) -> dict[str, float]:
        """Held-out loss and bits per byte on the experiment's own held-out split (text)."""
        if self.cfg.task != "text":
            raise ExportError(f"evaluate: task {self.cfg.task!r} is not text")
        n = num_batches or self.cfg.orchestration.eval_batches
        return evaluate(self.model_def, self.params, heldout_text_batches(self.cfg, n))

    def generate(self, prompt: bytes, max_new_tokens: int = 64, **kwargs) -> bytes:
        """Byte-level continuation of `prompt` (greedy unless a temperature is given)."""
        return generate(self.model_def, self.params, prompt, max_new_tokens, **kwargs)

    def to_nnx(self):
        """A plain Flax `nnx` module holding these parameters (the decoder: int32 tokens
        [B, L] -> (logits [B, L, vocab], the MoE auxiliary loss)), for code that wants the module
        rather than this flat dict."""
        from flax import nnx

        return nnx.merge(self.model_def.graphdef, self.model_def.to_state(self.params))


def load_exported(path: str | os.PathLike, fmt: str = "safetensors") -> ExportedModel:
    """Load an export written by `export_global` (or `diloco export`), verified."""
    root = Path(path)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        raise ExportError(f"{root}: no {MANIFEST} (not an export, or one that did not "
                          "finish)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{root / MANIFEST}: not JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != \
            EXPORT_FORMAT_VERSION:
        raise ExportError(f"{root / MANIFEST}: format_version must be {EXPORT_FORMAT_VERSION}")
    if fmt not in manifest.get("formats", []):
        raise ExportError(f"format {fmt!r}: this export has {manifest.get('formats')}")
    checksums = manifest.get("sha256") or {}
    config_bytes = _verified(root / CONFIG, checksums.get(CONFIG))
    cfg = config_from_mapping(json.loads(config_bytes))
    if fmt == "safetensors":
        from safetensors.numpy import load

        params = load(_verified(root / SAFETENSORS, checksums.get(SAFETENSORS)))
    else:
        import orbax.checkpoint as ocp

        # Restored into the model's own skeleton: Orbax checks names and shapes against it.
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                params = checkpointer.restore((root / ORBAX).absolute(),
                                              abstract_params(cfg.model))
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise ExportError(f"{root / ORBAX}: {str(err).splitlines()[0][:300]}") from None
        params = {k: np.asarray(v) for k, v in params.items()}
    _check_params(cfg, params, str(root))
    return ExportedModel(cfg, make_model_def(cfg.model),
                         {k: jnp.asarray(v) for k, v in params.items()}, manifest)


def _verified(path: Path, expected: str | None) -> bytes:
    if not isinstance(expected, str):
        raise ExportError(f"{path.name}: the manifest has no checksum for it")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ExportError(f"{path}: missing") from None
    if sha256(data) != expected:
        raise ExportError(f"{path}: checksum mismatch (changed or truncated since the export)")
    return data


def _check_params(cfg: ExperimentConfig, params: dict[str, np.ndarray], where: str) -> None:
    """Every parameter of the model and nothing else, each with its shape and dtype."""
    expected = abstract_params(cfg.model)
    if set(params) != set(expected):
        missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        raise ExportError(f"{where}: parameters do not match the model (missing "
                          f"{missing[:3]}, unexpected {extra[:3]})")
    for name, spec in expected.items():
        value = params[name]
        if tuple(value.shape) != tuple(spec.shape) or value.dtype != spec.dtype:
            raise ExportError(f"{where}: {name} is {value.dtype}{list(value.shape)}, the model "
                              f"has {spec.dtype}{list(spec.shape)}")
        if not math.isfinite(float(np.abs(value).max(initial=0.0))):
            raise ExportError(f"{where}: {name} is not finite")
