"""Baselines on the same data and token budget as a Decoupled DiLoCo run.

- Data-parallel: one model, every step takes one batch from each of the M learners' shards (a
  global batch of all their batches together) and applies one AdamW step. On the fake clock the
  step takes as long as the slowest learner (lock-step), and the whole job stalls while any
  learner is down (no elasticity), then restarts. Scavenged capacity (`simulation.capacity`)
  it does use: the global batch grows by the batches of the extra learners while they are
  there (an elastic batch), at the price `simulation.capacity_allreduce_seconds` (capacity in
  another site: every step's all-reduce crosses the inter-site link) and
  `simulation.capacity_restart_seconds` (each join or leave restarts the job) set.
- Synchronous DiLoCo: the simulator itself with K = M, P = 1, tau = 0, no grace window, plain
  mean: every learner waits for every other at each sync.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from diloco_core.config import ExperimentConfig
from diloco_core.evaluation import evaluate
from diloco_core.inner_step import InnerStep
from diloco_core.model import init_model, param_count
from diloco_core.objectives import batch_tokens, concat_batches
from diloco_core.shards import heldout_data, learner_data
from diloco_core.simulation_result import LearnerStats, SimulationResult
from diloco_core.simulator import Progress, run_simulation


def synchronous_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """The synchronous-DiLoCo counterpart of a config (same H, learners, data and budget): one
    fragment, every learner in every round, and a barrier at every sync (pacing with tau = 0)."""
    sync = dataclasses.replace(
        cfg.sync, num_fragments=1, overlap_steps=0, min_quorum=cfg.learners.num_learners,
        block_on_overlap=True,
        grace_gamma=0.0, grace_min_seconds=0.0, merge_rule="mean", weighting="uniform",
        receive_rule="overwrite")
    return cfg.replace(sync=sync)


def run_synchronous_diloco(cfg: ExperimentConfig, learner_streams: Sequence[np.ndarray],
                           heldout_stream: np.ndarray, progress: Progress | None = None
                           ) -> SimulationResult:
    return run_simulation(synchronous_config(cfg), learner_streams, heldout_stream,
                          method="synchronous_diloco", progress=progress)


def _stalled_until(t: float, cfg: ExperimentConfig) -> float:
    """If any learner is down at time t, the time the last overlapping outage ends."""
    end = t
    changed = True
    while changed:
        changed = False
        for outage in cfg.simulation.outages:
            if outage.start <= end < outage.end:
                end, changed = outage.end, True
    return end


def _first_failure_in(start: float, end: float, cfg: ExperimentConfig) -> float | None:
    """The first outage that begins strictly inside (start, end), if any."""
    starts = [o.start for o in cfg.simulation.outages if start < o.start < end]
    return min(starts) if starts else None


def _present(windows: dict[int, tuple[float, float]], m: int, t: float) -> list[int]:
    """The learners part of the run at time t (`ExperimentConfig.capacity_windows`)."""
    return [i for i in range(m) if i not in windows or windows[i][0] <= t < windows[i][1]]


def run_data_parallel(cfg: ExperimentConfig, learner_streams: Sequence[np.ndarray],
                      heldout_stream: np.ndarray, progress: Progress | None = None
                      ) -> SimulationResult:
    m = cfg.learners.num_learners
    model_def, params = init_model(cfg.model, cfg.seed)
    inner = InnerStep(model_def, cfg.inner, cfg.total_learner_steps)
    state = inner.init(params)
    iterators = [learner_data(cfg, i, stream) for i, stream in enumerate(learner_streams)]
    heldout = heldout_data(cfg, heldout_stream)
    sim = cfg.simulation
    rng = np.random.default_rng([cfg.seed, 10_000])
    stats = [LearnerStats(name) for name in cfg.learners.learner_names]
    speeds = cfg.learners.learner_speeds
    eval_interval_tokens = cfg.token_budget // sim.eval_points
    next_eval = eval_interval_tokens
    grad_bytes_per_learner = param_count(cfg.model) * 2  # bf16 gradients, every step
    t, tokens, up_time, step, losses, evals = 0.0, 0, 0.0, 0, [], []
    learner_steps = 0    # gradients exchanged: one per learner present at each step
    windows = cfg.capacity_windows()
    previous = None      # the learners present at the last step: a change is a restart
    while tokens < cfg.token_budget:
        restart = _stalled_until(t, cfg)
        if restart > t:
            for s in stats:
                s.down_seconds += restart - t  # the whole job is stalled, all chips allocated
            t = restart
        # Elastic under `simulation.capacity`: each step is one update on the batches of the
        # learners present (a larger global batch while extra capacity is there). A change in
        # who is present restarts the job (re-shard, relaunch) before the step.
        present = _present(windows, m, t)
        while sim.capacity_restart_seconds and previous is not None and present != previous:
            for i in range(m):   # every chip of the new roster waits for the restart
                if i in present:
                    stats[i].down_seconds += sim.capacity_restart_seconds
                else:
                    stats[i].absent_seconds += sim.capacity_restart_seconds
            t += sim.capacity_restart_seconds
            previous, present = present, _present(windows, m, t)
        previous = present
        durations = [sim.step_seconds / speeds[i] * max(
            1.0 + sim.step_jitter * rng.standard_normal() if sim.step_jitter else 1.0, 0.1)
            for i in present]
        # Scavenged capacity in another site: every step all-reduces the gradients over the
        # inter-site link, and the step waits for it.
        remote = any(i in windows for i in present)
        step_time = max(durations) + (sim.capacity_allreduce_seconds if remote else 0.0)
        failed_at = _first_failure_in(t, t + step_time, cfg)
        if failed_at is not None:  # a learner fails mid-step: the step is lost, the job stalls
            for s in stats:
                s.lost_seconds += failed_at - t
            t = failed_at
            continue
        parts = [iterators[i].next() for i in present]
        batch = concat_batches(parts)
        state, metrics = inner.step(state, batch)
        losses.append(metrics["loss"])
        for i, d, part in zip(present, durations, parts, strict=True):
            stats[i].busy_seconds += d
            stats[i].idle_seconds += step_time - d
            stats[i].steps += 1
            stats[i].tokens += batch_tokens(part)
        for i in set(range(m)) - set(present):
            stats[i].absent_seconds += step_time
        learner_steps += len(present)
        t += step_time
        up_time += step_time
        tokens += batch_tokens(batch)
        step += 1
        if progress:
            progress(tokens, cfg.token_budget)
        if tokens >= next_eval or tokens >= cfg.token_budget:
            next_eval = tokens + eval_interval_tokens
            evals.append({"time": t, "tokens": tokens, "round": step,
                          **evaluate(model_def, state.params, heldout)})
    loss_values = [float(x) for x in np.asarray(losses)]
    for s in stats:
        s.train_loss = loss_values
    return SimulationResult(
        method="data_parallel", wall_seconds=t, tokens_processed=tokens, evals=evals, merges=[],
        learners=stats, uptime=up_time / t if t else 1.0,
        bytes_up=grad_bytes_per_learner * learner_steps,
        bytes_down=grad_bytes_per_learner * learner_steps,
        final_params=state.params)
