"""Held-out evaluation of the current global parameters (all fragments, current versions)."""

import functools

import jax.numpy as jnp

from diloco_core.config import ModelConfig
from diloco_core.config_loading import config_from_mapping
from diloco_core.evaluation import evaluate, generate
from diloco_core.model import ModelDef, make_model_def
from resources.store.artifact_store import ArtifactStore
from resources.store.summary_records import HeldoutEval
from resources.task_data import heldout_text_batches

SAMPLE_PROMPT = b"def "
SAMPLE_BYTES = 48


def evaluate_global(store: ArtifactStore, num_batches: int | None = None,
                    version: int | None = None) -> HeldoutEval:
    """Loss, bits per byte and a short greedy sample of the global model: the current versions,
    or `version` of every fragment (0: the initial parameters)."""
    cfg, params, versions = global_params(store, version)
    num_batches = num_batches or cfg.orchestration.eval_batches
    model_def = _model_def(cfg.model)
    result = evaluate(model_def, params, heldout_text_batches(cfg, num_batches))
    sample = generate(model_def, params, SAMPLE_PROMPT, SAMPLE_BYTES)
    return HeldoutEval(loss=float(result["loss"]), bits_per_byte=float(result["bits_per_byte"]),
                       sample=(SAMPLE_PROMPT + sample).decode("utf-8", errors="replace"),
                       versions=tuple(versions), batches=num_batches)


@functools.lru_cache(maxsize=4)
def _model_def(model: ModelConfig) -> ModelDef:
    """One model definition per model config: building it traces the whole module abstractly
    (about 0.1 s on 2 cores), and the syncer evaluates every few rounds in its polling loop."""
    return make_model_def(model)


def global_params(store: ArtifactStore, version: int | None = None):
    """The experiment's config and its global parameters, every fragment at its current version
    (or at `version`; 0: the initial parameters): (cfg, flat params, each fragment's version)."""
    cfg = config_from_mapping(store.get_config())
    fragments = [store.load_global(p, version) for p in range(cfg.sync.num_fragments)]
    params = {k: jnp.asarray(v) for f in fragments for k, v in f.params.items()}
    return cfg, params, [f.version for f in fragments]
