"""Starting a training run: the experiment config and the initial global parameters.

Launch the `train` job from the launchpad (the config form's defaults run out of the box) or
from the CLI (`diloco demo`). The config is validated before any compute; a bad field fails
the run with the field and the reason. The experiment then becomes the active one: the learner
supervisor dispatches its learners and the quorum sensor starts opening rounds.
"""

import time

import dagster as dg
from pydantic import Field

from pipelines.config_schema import form_model
from pipelines.defs.partitions import learners
from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS, require_orchestratable
from pipelines.partition_keys import learner_partition_key
from resources.compute import LearnerCompute
from resources.store.resource import ArtifactStoreResource

ExperimentForm = form_model()


class TrainingConfig(dg.Config):
    experiment: ExperimentForm = Field(
        default_factory=ExperimentForm,
        description="Every field of the experiment config, typed; a field left empty keeps its "
                    "default (in its description). Layered over the config file, under the "
                    "overrides. Reference: docs/config.md")
    config_path: str | None = Field(
        default=None, description="YAML or TOML experiment config (default: embedded defaults)")
    overrides: list[str] = Field(
        default=[], description="field.path=value overrides, applied last, e.g. "
                                "sync.min_quorum=2")
    orchestrated_defaults: bool = Field(
        default=True, description="start from the orchestrated defaults of `diloco demo` "
                                  "(4 learners at different speeds, a round every 4 steps) "
                                  "under the file and the overrides")
    fault_tape_path: str | None = Field(
        default=None, description="chaos runs only (orchestration.chaos=true): a JSON fault "
                                  "tape (see docs/chaos.md) whose faults are injected into "
                                  "this run")
    replace_active: bool = Field(
        default=False, description="start even though another experiment of this store is "
                                   "active and unfinished: the sensors then follow this one and "
                                   "the other is no longer supervised or merged (it can be "
                                   "resumed later by launching it again)")


@dg.multi_asset(
    specs=[
        dg.AssetSpec("experiment", group_name="diloco", kinds={"python"},
                     description="The experiment config of the training run, as committed to "
                                 "the store (write-once): model, data, learners, M, H, P, K, "
                                 "grace, outer optimizer, token budget."),
        dg.AssetSpec("initial_params", deps=["experiment"], group_name="diloco",
                     kinds={"jax"},
                     description="Version 0 of every global fragment (the seeded model init) "
                                 "and its outer-optimizer state."),
    ],
    can_subset=False,
)
def start_experiment(context: dg.AssetExecutionContext, config: TrainingConfig,
                     store: ArtifactStoreResource, learner_compute: LearnerCompute):
    from diloco_core.config import ConfigError
    from diloco_core.config_loading import config_to_mapping

    try:
        cfg = _experiment_config(config)
    except ConfigError as err:
        raise dg.Failure(description=f"invalid experiment config: {err}") from None
    try:   # every learner's region must be placed before anything is written
        learner_compute.deployment().check_learners(cfg.learners)
    except ConfigError as err:
        raise dg.Failure(description=f"invalid deployment: {err}") from None
    tape = _load_tape(config.fault_tape_path, cfg.learners.learner_names)
    if tape is not None and not cfg.orchestration.chaos:
        raise dg.Failure(description=(
            "fault_tape_path: a fault tape is injected only into a chaos run; launch it as one "
            "(orchestration.chaos=true, as `diloco demo --fault-tape` does) or leave the tape "
            "out"))
    _refuse_to_orphan(store, cfg.name, config.replace_active)

    import jax

    from diloco_core.fragments import plan_fragments, split_params
    from diloco_core.model import init_model, param_count
    from diloco_core.outer import outer_optimizer_for
    from resources.store.artifact_store import Conflict

    artifacts = store.store(cfg.name)
    try:
        artifacts.put_config(config_to_mapping(cfg))
    except Conflict:
        _resume_with_a_larger_budget(context, artifacts, cfg)
    if tape is not None:
        try:
            artifacts.put_fault_tape(tape)
        except Conflict:
            raise dg.Failure(description=f"experiment {cfg.name!r} already has a different "
                                         "fault tape") from None
        from diloco_core.fault_tape import CAPACITY_KINDS, DAGSTER_KINDS

        driven = [f["id"] for f in tape["faults"] if f["kind"] in DAGSTER_KINDS]
        capacity = [f["id"] for f in tape["faults"] if f["kind"] in CAPACITY_KINDS]
        context.log.warning(
            f"chaos run: {len(tape['faults']) - len(driven) - len(capacity)} faults will be "
            "injected by the learners and merges"
            + (f"; {len(capacity)} capacity changes ({', '.join(capacity)}) are applied by "
               "the learner supervisor as their rounds open" if capacity else "")
            + (f"; {len(driven)} Dagster restarts ({', '.join(driven)}) are executed only by "
               "the driver that owns the instance (`diloco demo --fault-tape`), not by this "
               "job" if driven else ""))
    _, params = init_model(cfg.model, cfg.seed)
    plan = plan_fragments({k: v.shape for k, v in params.items()}, cfg.sync.num_fragments)
    tx = outer_optimizer_for(cfg)
    for p, fragment in enumerate(split_params(params, plan)):
        if artifacts.current_version(p) is None:
            artifacts.commit_global(p, 0, jax.device_get(fragment), tx.init(fragment),
                                    {"round": None, "initial": True})
    names = list(cfg.learners.learner_names)
    # A standby learner gets its partition when it joins (the learner supervisor adds it).
    context.instance.add_dynamic_partitions(
        learners.name, [learner_partition_key(cfg.name, n) for n in names
                        if n not in cfg.learners.standby_names])
    store.set_active(cfg.name)
    context.log.info(f"experiment {cfg.name} is active: {len(names)} learners, "
                     f"{param_count(cfg.model):,} parameters in {plan.num_fragments} fragments")
    s = cfg.sync
    yield dg.MaterializeResult(asset_key="experiment", metadata={
        "experiment": cfg.name, "store": dg.MetadataValue.path(artifacts.blobs.uri),
        "learners": ", ".join(names), "num_learners (M)": len(names),
        "standby": ", ".join(cfg.learners.standby_names) or "none",
        "min_quorum (K)": s.min_quorum, "sync_period (H)": s.sync_period,
        "num_fragments (P)": s.num_fragments, "overlap_steps (tau)": s.overlap_steps,
        "grace_gamma": s.grace_gamma, "encoding": s.encoding, "merge_rule": s.merge_rule,
        "token_budget": cfg.token_budget, "model_preset": cfg.model.preset,
        "config": dg.MetadataValue.json(config_to_mapping(cfg)),
    })
    yield dg.MaterializeResult(asset_key="initial_params", metadata={
        "parameters": param_count(cfg.model),
        "fragment_sizes": dg.MetadataValue.json(list(plan.sizes)),
        "seed": cfg.seed,
    })


def _experiment_config(config: TrainingConfig):
    """The experiment config the launch describes: defaults <- orchestrated defaults <- file <-
    form <- overrides, validated, and runnable by the orchestrated path; raises ConfigError."""
    from pipelines.commands.config_layers import load_config
    from pipelines.config_schema import form_to_mapping

    base = ORCHESTRATED_DEFAULTS if config.orchestrated_defaults else ()
    cfg = load_config(config.config_path, list(config.overrides), base=base,
                      form=form_to_mapping(config.experiment))
    require_orchestratable(cfg)
    return cfg


def _resume_with_a_larger_budget(context, artifacts, cfg) -> None:
    """A relaunch whose config differs from the stored one only in a larger `token_budget`
    resumes the run with that budget (`BUDGET` in the store, read by the syncer's STOP rule);
    any other difference is a new experiment that needs another name. The learners' schedule
    keeps the horizon of the original budget: past it they train at its final learning rate."""
    from diloco_core.config_loading import config_from_mapping, config_to_mapping

    stored = config_from_mapping(artifacts.get_config())
    if config_to_mapping(stored.replace(token_budget=cfg.token_budget)) != config_to_mapping(cfg):
        raise dg.Failure(description=(
            f"experiment {cfg.name!r} already exists in {artifacts.blobs.uri} with a different "
            "config; choose another `name` (a resume may change only token_budget, upwards)"))
    current = artifacts.token_budget(stored.token_budget)
    if cfg.token_budget == current:
        return
    if cfg.token_budget < current:
        raise dg.Failure(description=(
            f"token_budget: {cfg.token_budget:,} is below the run's budget of {current:,}; a "
            "budget can only be raised (end the run early with `diloco stop`)"))
    if artifacts.stop_requested() is not None or artifacts.finished() is not None:
        raise dg.Failure(description=(
            f"token_budget: experiment {cfg.name!r} has already stopped (STOP written, final "
            "rounds merged or under way); its budget can no longer be raised: start a new "
            "experiment from its export"))
    budget = artifacts.raise_token_budget(cfg.token_budget, stored.token_budget, {
        "by": context.run.tags.get("dagster/user") or f"Dagster run {context.run.run_id[:8]}",
        "previous": current, "time": time.time()})
    context.log.info(f"experiment {cfg.name}: token budget raised from {current:,} to "
                     f"{budget:,} tokens")


def _refuse_to_orphan(store: ArtifactStoreResource, name: str, replace_active: bool) -> None:
    """One experiment is active per store (the sensors follow it). Starting another while it
    is unfinished would leave it running unsupervised, with its rounds never merged: refused
    unless the operator says so. Launching the active experiment again resumes it."""
    active = store.active()
    if active is None or active.experiment == name or replace_active:
        return
    if active.finished() is None:
        raise dg.Failure(description=(
            f"experiment {active.experiment!r} is still active in {store.base_uri} (its final "
            f"rounds are not done): stop it first (`diloco stop`), launch {name!r} on another "
            "store, or set replace_active to start it anyway"))


def _load_tape(path: str | None, learner_names) -> dict | None:
    """The fault tape as validated plain data, or a Failure naming the field (before anything
    is written)."""
    if not path:
        return None
    from diloco_core.fault_tape import TapeError
    from resources.chaos.faults import read_tape_file

    try:
        return read_tape_file(path, list(learner_names)).to_mapping()
    except TapeError as err:
        raise dg.Failure(description=f"fault_tape_path: invalid fault tape: {err}") from None


class _StartExperimentOp(dg.Config):
    config: TrainingConfig = Field(default_factory=TrainingConfig)


class _TrainOps(dg.Config):
    start_experiment: _StartExperimentOp = Field(default_factory=_StartExperimentOp)


class TrainRunConfig(dg.Config):
    """The `train` job's run config, in the shape of the op's own (`ops.start_experiment.config`),
    checked as a whole when the run is launched."""

    ops: _TrainOps = Field(default_factory=_TrainOps)


@dg.config_mapping
def checked_at_launch(run: TrainRunConfig) -> dg.RunConfig:
    """The whole experiment config validated when a run is launched, before Dagster creates it:
    Dagster's schema types each field of the form, but a check across fields (K <= M, a sync
    period that P divides, a sequence longer than the model's) needs the sections themselves.
    A bad config is refused at the launchpad's Launch (or the GraphQL submit) naming its field,
    and no run exists; the op checks again (and the deployment) when it runs."""
    from diloco_core.config import ConfigError

    config = run.ops.start_experiment.config
    try:
        _experiment_config(config)
    except ConfigError as err:
        raise dg.DagsterInvalidConfigError(
            f"invalid experiment config: {err}", [], config.model_dump()) from None
    return dg.RunConfig(ops={"start_experiment": config})


train_job = dg.define_asset_job(
    "train", selection=["experiment", "initial_params"], executor_def=dg.in_process_executor,
    config=checked_at_launch,
    description="Start a Decoupled DiLoCo training run: commit the config and the initial "
                "parameters, then the sensors take over (learners, rounds, merges, evals).")
