"""The in-process reference simulator: M learners and the syncer on one fake clock.

It runs the real model, inner step, contributions, quorum policy and merge on CPU; only time is
simulated. Each learner steps at its own speed (with optional jitter) and can be down for stretches
of the failure schedule. Events are processed in (time, sequence) order, so the same config and
seed give bitwise-identical results.

How rounds flow (the model this simulator commits to):
- Rounds open, are offered to and are decided by the round protocol (`round_protocol`, the
  rules the syncer service, the quorum sensor and the learner runtime run too): round r syncs
  fragment r mod P; it opens once round r-1 is decided and K live learners have each processed
  H/P steps' worth of tokens since round r-1 opened, so rounds come one every H/P steps of the
  K-th fastest learner, and each fragment once every H such steps.
- A learner offers the open round its current fragment (delta against its anchor, counters since
  it last received that fragment) at its first step boundary after the round opens, unless an
  offer of that fragment is still in flight or it has nothing new.
- The round merges under the quorum/grace policy (`quorum.decide`); the merged fragment reaches
  every live learner `sync_seconds` later and is applied at its next step boundary.
- A learner never waits unless it would run more than tau steps past an obligation: more than
  H/P + tau steps since the last round opened (no quorum: the run cannot advance), or more than
  tau steps past an offer whose round has not come back. With K < M and the grace window bounded
  by the slack, neither happens in steady state; with K = M, P = 1, tau = 0 this is synchronous
  DiLoCo, where every learner waits at every sync.
- A learner that fails loses the step in progress; contributions it already offered stay valid.
  When it comes back it rejoins from the current global parameters and a healthy peer's AdamW
  state, and continues its own data shard.
- When the token budget is reached, open rounds are decided, then every fragment gets a final
  round with every live learner, so the final global parameters include all of their progress.
"""

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from diloco_core.config import ExperimentConfig
from diloco_core.contribution import Contribution
from diloco_core.data import BatchIterator, heldout_batches
from diloco_core.evaluation import evaluate
from diloco_core.fragments import fragment_of_round, join_fragments, plan_fragments, split_params
from diloco_core.image_data import ExampleIterator, Examples
from diloco_core.inner_step import InnerStep, TrainState
from diloco_core.learner import LearnerSync
from diloco_core.model import init_model, is_embedding
from diloco_core.objectives import batch_tokens, concat_batches
from diloco_core.outer import outer_optimizer_for
from diloco_core.quorum import Estimates
from diloco_core.round_protocol import (
    decide_round,
    final_rounds,
    held_by_pacing,
    offer_choice,
    ready_to_open,
    tokens_needed,
)
from diloco_core.simulation_result import LearnerStats, Rejoin, SimulationResult
from diloco_core.syncer import SyncerState, merge_round

Progress = Callable[[int, int], None]


@dataclass
class _Learner:
    index: int
    name: str
    speed: float
    rng: np.random.Generator
    train: TrainState
    sync: LearnerSync
    data: BatchIterator
    stats: LearnerStats
    up: bool = True
    generation: int = 0                      # bumps on failure: stale step events are ignored
    steps_since_open: int = 0
    tokens_since_open: int = 0
    blocked_since: float | None = None
    down_since: float | None = None
    offered: dict[int, int] = field(default_factory=dict)   # round -> learner step of the offer
    inbox: list[tuple[int, int, dict]] = field(default_factory=list)  # (round, version, values)
    losses: list = field(default_factory=list)
    rejoined_at: float | None = None
    down_at: float | None = None
    step_started_at: float | None = None     # a step is in progress (at most one per learner)
    absent_since: float | None = None        # scavenged capacity: not part of the run now


@dataclass
class _Round:
    index: int
    fragment: int
    opened_at: float
    arrivals: dict[str, float] = field(default_factory=dict)
    contributions: dict[str, Contribution] = field(default_factory=dict)
    decided: bool = False
    deadline_event: float | None = None


def learner_data(cfg: ExperimentConfig, index: int, stream: np.ndarray | Examples
                 ) -> BatchIterator | ExampleIterator:
    """Learner `index`'s batches: its own shard (a token stream, or labelled images for the
    digits task), its own seeded order (shared with baselines)."""
    seed = cfg.seed * 1000 + index
    if cfg.task == "digits":
        return ExampleIterator(stream, cfg.learner_batch_sizes[index], seed=seed)
    return BatchIterator(stream, cfg.learner_batch_sizes[index], cfg.data.seq_len, seed=seed)


def heldout_data(cfg: ExperimentConfig, heldout: np.ndarray | Examples):
    """What `evaluation.evaluate` scores: eval_batches batches of text, or every held-out
    image."""
    if cfg.task == "digits":
        return heldout.as_batch()
    return heldout_batches(heldout, cfg.data.batch_size, cfg.data.seq_len,
                           cfg.simulation.eval_batches)


def _copy(tree):
    """Fresh buffers: learner states are donated to the jitted step, the syncer's must survive."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


class Simulation:
    """One simulated run. Use `run_simulation` unless you need to poke at the internals."""

    def __init__(self, cfg: ExperimentConfig, learner_streams: Sequence[np.ndarray],
                 heldout_stream: np.ndarray, method: str = "decoupled",
                 progress: Progress | None = None):
        m = cfg.learners.num_learners
        if len(learner_streams) != m:
            raise ValueError(f"{len(learner_streams)} learner streams for {m} learners")
        self.cfg, self.method, self.progress = cfg, method, progress
        self.sync_cfg = cfg.sync
        self.model_def, params = init_model(cfg.model, cfg.seed)
        self.plan = plan_fragments({k: v.shape for k, v in params.items()},
                                   cfg.sync.num_fragments)
        self.inner = InnerStep(self.model_def, cfg.inner, cfg.total_learner_steps)
        self.tx = outer_optimizer_for(cfg)
        self.syncer = SyncerState.start(split_params(params, self.plan), self.tx)
        self.heldout = heldout_data(cfg, heldout_stream)
        self.estimates = Estimates(step_seconds=cfg.simulation.step_seconds,
                                   sync_seconds=cfg.simulation.sync_seconds)
        self.learners = [
            _Learner(i, name, speed, np.random.default_rng([cfg.seed, i]),
                     self.inner.init(_copy(params)),
                     LearnerSync.start(name, list(self.syncer.fragments),
                                       list(self.syncer.versions)),
                     learner_data(cfg, i, learner_streams[i]),
                     LearnerStats(name))
            for i, (name, speed) in enumerate(zip(cfg.learners.learner_names,
                                                  cfg.learners.learner_speeds, strict=True))]
        self.rounds: dict[int, _Round] = {}
        self.next_round = 0
        self.last_open_at = -math.inf
        self.merges = []
        self.merge_times: dict[int, float] = {}
        # Round -> the learners whose offers its merge took (empty if it merged nothing).
        self.merged_members: dict[int, frozenset[str]] = {}
        self.evals: list[dict] = []
        self.rejoins: list[Rejoin] = []
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.up_time = 0.0
        self.tokens = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.merged_tokens = 0
        # Evaluate after the first merge past every budget / eval_points tokens, and at the end.
        self.eval_interval_tokens = cfg.token_budget // cfg.simulation.eval_points
        self.next_eval_tokens = self.eval_interval_tokens
        self.tokens_needed = tokens_needed(cfg)
        self.step_tokens = dict(zip(cfg.learners.learner_names, cfg.learner_step_tokens,
                                    strict=True))
        self.finished = False

    # ---- event plumbing -------------------------------------------------------------------
    def _push(self, time: float, kind: str, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, payload))

    def _advance_clock(self, t: float) -> None:
        progressing = sum(1 for lr in self.learners if lr.up and lr.blocked_since is None)
        if progressing >= self.sync_cfg.min_quorum:
            self.up_time += t - self.now
        self.now = t

    def _step_seconds(self, learner: _Learner) -> float:
        sim = self.cfg.simulation
        jitter = 1.0 + sim.step_jitter * learner.rng.standard_normal() if sim.step_jitter else 1.0
        return sim.step_seconds / learner.speed * max(jitter, 0.1)

    def _schedule_step(self, learner: _Learner, t: float) -> None:
        if learner.step_started_at is not None:
            return  # already stepping: one step chain per learner
        learner.step_started_at = t
        duration = self._step_seconds(learner)
        self._push(t + duration, "step", learner.index, learner.generation, duration)

    # ---- the run --------------------------------------------------------------------------
    def run(self) -> SimulationResult:
        if self.cfg.learners.warm_start_fraction:
            self._warm_start()
        for outage in self.cfg.simulation.outages:
            self._push(outage.start, "down", outage.learner)
            self._push(outage.end, "up", outage.learner)
        for index, (joins, leaves) in self.cfg.capacity_windows().items():
            if joins > 0:   # not here yet: no step, no offer, not live for quorums
                learner = self.learners[index]
                learner.up, learner.absent_since = False, 0.0
                if joins < math.inf:   # a standby learner without a window never joins
                    self._push(joins, "join", index)
            if leaves < math.inf:
                self._push(leaves, "leave", index)
        for learner in self.learners:
            if learner.up:
                self._schedule_step(learner, self.now)
        while self.events and not self.finished:
            t, _, kind, payload = heapq.heappop(self.events)
            self._advance_clock(t)
            getattr(self, f"_on_{kind}")(t, *payload)
        if not self.finished:
            raise RuntimeError("simulation ran out of events before the token budget was reached "
                               "(a learner is down forever and the quorum cannot be met)")
        self._finish()
        return self._result()

    def _warm_start(self) -> None:
        """`learners.warm_start_fraction`: train data-parallel (every step one AdamW update on
        all the learners' next batches, in lock-step: it lasts as long as the slowest) until
        that share of the budget, then fork: every learner continues from its parameters, AdamW
        state and step count (so the inner schedule goes on where it was), and the global
        parameters restart from them with a fresh outer state. Each learner keeps reading its
        own shard, so the data stays disjoint across the fork."""
        target = int(self.cfg.learners.warm_start_fraction * self.cfg.token_budget)
        state = self.inner.init(join_fragments(self.syncer.fragments))
        t = 0.0
        while self.tokens < target:
            durations = [self._step_seconds(learner) for learner in self.learners]
            parts = [learner.data.next() for learner in self.learners]
            state, _ = self.inner.step(state, concat_batches(parts))
            step_time = max(durations)
            for learner, duration, part in zip(self.learners, durations, parts, strict=True):
                learner.stats.steps += 1
                learner.stats.tokens += batch_tokens(part)
                learner.stats.busy_seconds += duration
                learner.stats.idle_seconds += step_time - duration
                self.tokens += batch_tokens(part)
            t += step_time
            if self.progress:
                self.progress(self.tokens, self.cfg.token_budget)
        self._advance_clock(t)
        self.syncer = SyncerState.start(split_params(state.params, self.plan), self.tx)
        for learner in self.learners:
            learner.train = TrainState(params=_copy(state.params),
                                       opt_state=_copy(state.opt_state), step=state.step,
                                       tokens=jnp.asarray(learner.stats.tokens, jnp.int32))
            learner.sync = LearnerSync.start(learner.name, list(self.syncer.fragments),
                                             list(self.syncer.versions))
        while self.next_eval_tokens <= self.tokens:
            self.next_eval_tokens += self.eval_interval_tokens

    def _on_step(self, t: float, index: int, generation: int, duration: float) -> None:
        learner = self.learners[index]
        if generation != learner.generation or not learner.up:
            return  # the learner failed during this step: the step is lost
        started, learner.step_started_at = learner.step_started_at, None
        batch = learner.data.next()
        learner.train, metrics = self.inner.step(learner.train, batch)
        tokens = batch_tokens(batch)
        learner.sync = learner.sync.after_step(tokens)
        learner.losses.append(metrics["loss"])
        learner.stats.steps += 1
        learner.stats.tokens += tokens
        learner.stats.busy_seconds += duration
        # Count only steps begun after the last round opened: a step that was already running
        # when it opened (even one ending at the same instant as the step that opened it)
        # belongs to the previous interval. Otherwise, with equal step times, the learners
        # whose step events are processed after the opener's run one step ahead of it, open
        # the next round a step early, and the opener misses it every time.
        if started >= self.last_open_at:
            learner.steps_since_open += 1
            learner.tokens_since_open += tokens
        self.tokens += tokens
        self.estimates = self.estimates.observe(self.sync_cfg.ema_decay,
                                                step=duration)
        if self.progress:
            self.progress(self.tokens, self.cfg.token_budget)
        self._apply_inbox(learner)
        if self.tokens >= self.cfg.token_budget:
            self.finished = True
            return
        self._boundary(learner, t)

    def _on_down(self, t: float, index: int) -> None:
        learner = self.learners[index]
        if not learner.up:
            return
        self._unblock(learner, t)
        if learner.step_started_at is not None:
            learner.stats.lost_seconds += t - learner.step_started_at
            learner.step_started_at = None
        if learner.rejoined_at is not None:  # failed again before any merge admitted it
            self.rejoins.append(Rejoin(learner.name, learner.down_at, learner.rejoined_at, None))
            learner.rejoined_at = None
        learner.up = False
        learner.generation += 1
        learner.down_since = learner.down_at = t
        learner.offered.clear()
        learner.inbox.clear()
        for rnd in self._open_rounds():
            self._evaluate(rnd, t)   # the live set shrank: a round may now be complete
        self._maybe_open_round(t)

    def _on_up(self, t: float, index: int) -> None:
        learner = self.learners[index]
        if learner.up:
            return
        learner.stats.down_seconds += t - learner.down_since
        peers = [p for p in self.learners if p.up]
        # Rejoin: global parameters from the syncer, AdamW state from the most advanced healthy
        # peer (the learner's own state is stale by the whole outage), its own data position.
        donor = max(peers, key=lambda p: p.stats.steps).train if peers else learner.train
        params = _copy(join_fragments(self.syncer.fragments))
        learner.train = TrainState(params=params, opt_state=_copy(donor.opt_state),
                                   step=donor.step, tokens=learner.train.tokens)
        learner.sync = LearnerSync.start(learner.name, list(self.syncer.fragments),
                                         list(self.syncer.versions))
        learner.up, learner.down_since, learner.rejoined_at = True, None, t
        learner.steps_since_open = learner.tokens_since_open = 0
        self._boundary(learner, t)

    def _on_join(self, t: float, index: int) -> None:
        """Scavenged capacity arrives: a new learner starts as a rejoining one does (global
        parameters, the most advanced peer's AdamW state and step) on its own shard, which
        nobody has read, so the data stays disjoint."""
        learner = self.learners[index]
        learner.stats.absent_seconds += t - learner.absent_since
        learner.absent_since, learner.down_since = None, t   # absent, not down: no downtime
        self._on_up(t, index)
        learner.rejoined_at = None    # a join, not the return of a failed learner

    def _on_leave(self, t: float, index: int) -> None:
        """The capacity is reclaimed: the learner is gone for good, like a failure that never
        ends (its step in progress and its offers in flight are lost), counted as absent."""
        learner = self.learners[index]
        if not learner.up:
            return
        self._on_down(t, index)
        learner.down_since, learner.absent_since = None, t

    def _on_deliver(self, t: float, round_index: int, version: int, values: dict | None) -> None:
        for learner in self.learners:
            if not learner.up:
                continue
            learner.inbox.append((round_index, version, values))
            if values is not None:
                self.bytes_down += sum(int(v.size) * 4 for v in values.values())
            if learner.blocked_since is not None:
                self._apply_inbox(learner)
                self._boundary(learner, t)

    def _on_deadline(self, t: float, round_index: int) -> None:
        rnd = self.rounds[round_index]
        rnd.deadline_event = None
        if not rnd.decided:
            self._evaluate(rnd, t)
            self._maybe_open_round(t)

    # ---- learners at step boundaries --------------------------------------------------------
    def _open_rounds(self) -> list[_Round]:
        return [r for r in self.rounds.values() if not r.decided]

    def _apply_inbox(self, learner: _Learner) -> None:
        for round_index, version, values in sorted(learner.inbox, key=lambda d: d[1]):
            if values is not None:
                fragment = self.rounds[round_index].fragment
                # The same rule as the real learner's: what each decided round's merge took.
                offered = learner.sync.fragments[fragment].offered_round
                took = {} if offered not in self.merged_members else {
                    offered: learner.name in self.merged_members[offered]}
                fate = learner.sync.offer_fate(fragment, round_index, took)
                params, learner.sync = learner.sync.receive(
                    learner.train.params, fragment, values, version,
                    self.sync_cfg.receive_rule, self.sync_cfg.blend_alpha, offer=fate)
                learner.train = learner.train.replace(params=params)
            learner.offered.pop(round_index, None)
        learner.inbox.clear()

    def _may_proceed(self, learner: _Learner) -> bool:
        return not held_by_pacing(learner.stats.steps, list(learner.offered.values()),
                                  learner.tokens_since_open, self.step_tokens[learner.name],
                                  self.cfg)

    def _unblock(self, learner: _Learner, t: float) -> None:
        if learner.blocked_since is not None:
            learner.stats.idle_seconds += t - learner.blocked_since
            learner.blocked_since = None

    def _boundary(self, learner: _Learner, t: float) -> None:
        """A learner between two steps: maybe open a round, offer, then step or wait."""
        self._maybe_open_round(t)
        for rnd in self._open_rounds():
            self._offer(learner, rnd, t)
        if self._may_proceed(learner):
            self._unblock(learner, t)
            self._schedule_step(learner, t)
        elif learner.blocked_since is None:
            learner.blocked_since = t

    def _offer(self, learner: _Learner, rnd: _Round, t: float) -> None:
        if rnd.decided or learner.name in rnd.arrivals or not learner.up:
            return
        if self._offer_choice(learner, rnd, final=False) != "offer":
            return
        contribution = learner.sync.contribution(
            learner.train.params, self.plan, rnd.fragment, rnd.index, learner.stats.steps, t,
            self.sync_cfg.encoding, self.sync_cfg.encoding_block_size)
        self._record_offer(learner, rnd, contribution, t)
        self._evaluate(rnd, t)

    def _record_offer(self, learner: _Learner, rnd: _Round, contribution: Contribution,
                      t: float) -> None:
        rnd.arrivals[learner.name] = t
        rnd.contributions[learner.name] = contribution
        learner.offered[rnd.index] = learner.stats.steps
        self.bytes_up += contribution.nbytes
        if self.sync_cfg.receive_rule == "rebase":
            learner.sync = learner.sync.after_offer(learner.train.params, self.plan, rnd.fragment,
                                                    rnd.index)

    def _offer_choice(self, learner: _Learner, rnd: _Round, final: bool,
                      stopped: bool = False) -> str:
        """The protocol's offer rule. Counters run from the last *receipt*, so while an offer of
        this fragment is in flight (merged or not, not yet received) a second offer would count
        its steps twice."""
        in_flight = any(self.rounds[r].fragment == rnd.fragment for r in learner.offered)
        return offer_choice(rnd.index, final, -1 if learner.name not in rnd.arrivals
                            else rnd.index, learner.sync.fragments[rnd.fragment].steps,
                            in_flight, stopped)

    def _maybe_open_round(self, t: float) -> None:
        if not ready_to_open({lr.name: lr.tokens_since_open for lr in self.learners},
                             self.tokens_needed, self._live(), self.sync_cfg.min_quorum,
                             previous_decided=not self._open_rounds()):
            return
        fragment = fragment_of_round(self.next_round, self.sync_cfg.num_fragments)
        rnd = _Round(self.next_round, fragment, t)
        self.rounds[rnd.index] = rnd
        self.next_round += 1
        self.last_open_at = t
        for learner in self.learners:
            learner.steps_since_open = learner.tokens_since_open = 0
        # Learners waiting at a boundary offer right away; the others at their next boundary.
        for learner in self.learners:
            if learner.up and learner.blocked_since is not None:
                self._offer(learner, rnd, t)
                if self._may_proceed(learner):
                    self._unblock(learner, t)
                    self._schedule_step(learner, t)

    # ---- the syncer -------------------------------------------------------------------------
    def _live(self) -> list[str]:
        return [lr.name for lr in self.learners if lr.up]

    def _evaluate(self, rnd: _Round, t: float) -> None:
        if rnd.decided:
            return
        decision = decide_round(t, rnd.arrivals, self._live(), self.estimates, self.cfg,
                                stopping=False, opened_at=rnd.opened_at)
        if decision.merge:
            quorum_at = sorted(rnd.arrivals.values())[self.sync_cfg.min_quorum - 1]
            self.estimates = self.estimates.observe(self.sync_cfg.ema_decay,
                                                    quorum=quorum_at - rnd.opened_at)
            self._merge(rnd, t, decision.members, decision.late, decision.reason)
            self._maybe_open_round(t)   # one round open at a time: the next may open now
        elif decision.deadline is not None and rnd.deadline_event != decision.deadline:
            rnd.deadline_event = decision.deadline
            self._push(decision.deadline, "deadline", rnd.index)

    def _merge(self, rnd: _Round, t: float, members: Sequence[str], late: Sequence[str],
               reason: str, final: bool = False) -> None:
        rnd.decided = True
        contributions = [rnd.contributions[name] for name in members]
        self.syncer, record = merge_round(
            self.syncer, self.plan, rnd.index, rnd.fragment, contributions, self.sync_cfg,
            self.tx, is_embedding, reason, late,
            average=final and self.cfg.outer.final_rounds == "average",
            step_tokens=dict(zip(self.cfg.learners.learner_names, self.cfg.learner_step_tokens,
                                 strict=True)))
        self.merges.append(record)
        self.merge_times[rnd.index] = t
        self.merged_members[rnd.index] = frozenset(record.members if record.merged else ())
        if record.merged:
            self.merged_tokens += sum(record.tokens)
            for learner in self.learners:
                if (learner.name in record.members and learner.rejoined_at is not None
                        and rnd.contributions[learner.name].clock >= learner.rejoined_at):
                    self.rejoins.append(Rejoin(learner.name, learner.down_at, learner.rejoined_at,
                                               t))
                    learner.rejoined_at = None
        values = self.syncer.fragments[rnd.fragment] if record.merged else None
        self._push(t + self.cfg.simulation.sync_seconds, "deliver", rnd.index,
                   self.syncer.versions[rnd.fragment], values)
        if record.merged and self.tokens >= self.next_eval_tokens:
            self._eval(t, rnd.index)

    def _eval(self, t: float, round_index: int) -> None:
        self.next_eval_tokens = self.tokens + self.eval_interval_tokens
        metrics = evaluate(self.model_def, join_fragments(self.syncer.fragments), self.heldout)
        self.evals.append({"time": t, "tokens": self.tokens, "round": round_index, **metrics})

    def _finish(self) -> None:
        """End of the budget: every live learner offers the open rounds, which merge; merges in
        flight land; then one final round per fragment merges whatever progress no offer covers
        yet. Only what overwrite discards anyway is left out (nothing under "rebase"): steps taken
        on a fragment while an offer of it was in flight (at most tau per fragment)."""
        t = self.now
        self.next_eval_tokens = math.inf  # one eval, after the final rounds
        for learner in self.learners:
            if learner.step_started_at is not None:  # steps still running are not useful work
                learner.stats.lost_seconds += t - learner.step_started_at
                learner.step_started_at = None
        for rnd in sorted(self._open_rounds(), key=lambda r: r.index):
            self._final_round(rnd, t, "run finished: every live learner offers the open round")
        for learner in self.learners:
            if learner.up:
                learner.inbox.extend(self._in_flight())
                self._apply_inbox(learner)
        for _ in range(final_rounds(self.sync_cfg.num_fragments)):
            # Round r is fragment r mod P here too, as on the orchestrated path.
            fragment = fragment_of_round(self.next_round, self.sync_cfg.num_fragments)
            rnd = _Round(self.next_round, fragment, t)
            self.rounds[rnd.index] = rnd
            self.next_round += 1
            self._final_round(rnd, t, "final round at the end of the token budget", final=True)
        self.events.clear()
        self._eval(t, self.next_round - 1)

    def _in_flight(self) -> list[tuple[int, int, dict | None]]:
        return [payload for (_, _, kind, payload) in self.events if kind == "deliver"]

    def _final_round(self, rnd: _Round, t: float, reason: str, final: bool = False) -> None:
        # After STOP a round waits for every live learner: each offers what no offer covers
        # yet, or declines (the learners answer at once here, so nobody is waited for).
        declined = []
        for learner in self.learners:
            if not learner.up:
                continue
            choice = self._offer_choice(learner, rnd, final=final, stopped=True)
            if choice == "offer":
                contribution = learner.sync.contribution(
                    learner.train.params, self.plan, rnd.fragment, rnd.index,
                    learner.stats.steps, t, self.sync_cfg.encoding,
                    self.sync_cfg.encoding_block_size)
                self._record_offer(learner, rnd, contribution, t)
            elif choice in ("decline", "wait"):
                declined.append(learner.name)   # "wait" only on an in-flight offer: no news
        decision = decide_round(t, rnd.arrivals, self._live(), self.estimates, self.cfg,
                                stopping=True, opened_at=rnd.opened_at, declined=declined)
        if decision.members:
            self._merge(rnd, t, decision.members, (), f"{reason}: {decision.reason}", final)
        else:
            rnd.decided = True

    def _result(self) -> SimulationResult:
        for learner in self.learners:
            if learner.losses:
                learner.stats.train_loss = [float(x) for x in np.asarray(jnp.stack(learner.losses))]
            if learner.blocked_since is not None:
                self._unblock(learner, self.now)
            if not learner.up and learner.down_since is not None:
                learner.stats.down_seconds += self.now - learner.down_since
            if learner.absent_since is not None:
                learner.stats.absent_seconds += self.now - learner.absent_since
        wall = self.now
        processed = self.tokens * self.sync_cfg.num_fragments
        return SimulationResult(
            method=self.method, wall_seconds=wall, tokens_processed=self.tokens,
            evals=self.evals, merges=self.merges, learners=[lr.stats for lr in self.learners],
            uptime=self.up_time / wall if wall else 1.0, bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            merged_token_fraction=self.merged_tokens / processed if processed else 0.0,
            rejoins=self.rejoins, merge_times=self.merge_times,
            final_params=join_fragments(self.syncer.fragments))


def run_simulation(cfg: ExperimentConfig, learner_streams: Sequence[np.ndarray],
                   heldout_stream: np.ndarray, method: str = "decoupled",
                   progress: Progress | None = None) -> SimulationResult:
    """Simulate one Decoupled DiLoCo run (or synchronous DiLoCo, given its config)."""
    return Simulation(cfg, learner_streams, heldout_stream, method, progress).run()
