"""The embedded defaults of an orchestrated run (`diloco demo` and the `train` job's launchpad).

They sit on top of the experiment defaults (`diloco_core/config.py`), which are tuned for the
in-process simulator: an orchestrated round costs a Dagster run, so rounds are spaced tens of
seconds apart (H/P = 16 steps) rather than every few steps.
"""

from diloco_core.config import ConfigError, ExperimentConfig

# 4 learners at different speeds on the stdlib corpus, rounds every H/P = 16 steps (tens of
# seconds on 2 cores, the granularity at which Dagster runs make sense), quorum K=2 with a short
# grace window. Layered under a config file and --set overrides.
ORCHESTRATED_DEFAULTS = [
    "name=diloco-demo",
    "token_budget=1600000",
    "learners.num_learners=4",
    "learners.speeds=[1.0, 1.0, 0.7, 0.5]",
    "sync.sync_period=64",
    "sync.num_fragments=4",
    "sync.min_quorum=2",
    "sync.overlap_steps=4",
    "sync.grace_min_seconds=3",
    "orchestration.checkpoint_every_steps=40",
    "orchestration.heartbeat_seconds=2",
    "orchestration.learner_timeout_seconds=30",
    "orchestration.restart_backoff_seconds=3",
]


def require_orchestratable(cfg: ExperimentConfig) -> None:
    """Refuse, before anything starts, what only the simulator runs: the learner processes read
    the text corpus, so the digits task is simulator-only (`diloco simulate`)."""
    if cfg.task != "text":
        raise ConfigError("task", f"{cfg.task!r} runs on the in-process simulator only "
                                  f"(diloco simulate --set task={cfg.task} ...); orchestrated "
                                  "training (train job, diloco demo) is 'text'")
