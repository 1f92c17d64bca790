"""Shared by the scripts that run a learner runtime in a fresh interpreter without Dagster
(tests/spmd_runtime_check.py, tests/multihost_learner_check.py): a store set up as the `train`
job sets it up, a logger whose lines a script can read back, and a bounded wait. Import it
after the script has set XLA_FLAGS."""

import logging
import time

import jax

from diloco_core.config_loading import config_from_mapping, config_to_mapping
from diloco_core.fragments import plan_fragments, split_params
from diloco_core.model import init_model
from diloco_core.outer import outer_optimizer_for
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store


def committed_experiment(root: str, name: str, overrides: list[str]) -> ArtifactStore:
    """What `start_experiment` commits: the config and version 0 of every fragment."""
    cfg = config_from_mapping({}, [*overrides, f"name={name}"])
    store = ArtifactStore(open_blob_store(root), name)
    store.put_config(config_to_mapping(cfg))
    _, params = init_model(cfg.model, cfg.seed)
    plan = plan_fragments({k: v.shape for k, v in params.items()}, cfg.sync.num_fragments)
    tx = outer_optimizer_for(cfg)
    for p, fragment in enumerate(split_params(params, plan)):
        store.commit_global(p, 0, jax.device_get(fragment), tx.init(fragment), {"round": None})
    return store


def wait(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def collecting_logger(name: str, lines: list[str]) -> logging.Logger:
    """A logger that appends each message to `lines` (what the runtime logged, for asserts)."""
    logger = logging.getLogger(f"test.{name}")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_Lines(lines))
    return logger
