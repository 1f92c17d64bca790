"""The in-process reference simulator: M learners and the syncer on one fake clock.

It runs the real model, inner step, contributions, merge and the syncer's own state machine
(`syncer_machine`, the one the syncer service runs) on CPU; only time is simulated. Each
learner steps at its own speed (with optional jitter) and can be down for stretches of the
failure schedule. Events are processed in (time, sequence) order, so the same config and seed
give bitwise-identical results.

How rounds flow:
- The syncer's side is the machine, ticked once per instant with events (`simulated_syncer`:
  the simulated world as the store would show it): it opens, decides, stops and finishes by the
  round protocol's rules (`round_protocol`), exactly as the syncer service does.
- A learner offers the open round its fragment's progress since it last received it at its
  first step boundary after the round opens (`round_protocol.offer_choice`); the merged fragment
  reaches the live learners `sync_seconds` after the decision, applied at their next boundary.
- A learner waits only when pacing holds it (`sync.block_on_overlap`, off by default, as on
  the real path); with K = M, P = 1, tau = 0 and pacing on this is synchronous DiLoCo.
- A learner that fails loses the step in progress; contributions it already offered stay valid.
  When it comes back it rejoins from the current global parameters and a healthy peer's AdamW
  state, and continues its own data shard.
- At STOP the learners stop training (a step in progress is not useful work) and answer the
  open round and the final rounds at once: each offers what no offer covers yet, declines, or
  waits for its offer in flight to come back and then offers.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from diloco_core.config import ExperimentConfig
from diloco_core.evaluation import evaluate
from diloco_core.event_queue import EventQueue
from diloco_core.fragments import join_fragments, plan_fragments, split_params
from diloco_core.inner_step import InnerStep, TrainState
from diloco_core.learner import LearnerSync
from diloco_core.model import init_model, is_embedding
from diloco_core.objectives import batch_tokens, concat_batches
from diloco_core.outer import outer_optimizer_for
from diloco_core.quorum import Estimates
from diloco_core.round_protocol import held_by_pacing, offer_choice
from diloco_core.shards import heldout_data, learner_data
from diloco_core.simulated_learner import SimulatedLearner
from diloco_core.simulated_syncer import SimulatedRound, SimulatedSyncer
from diloco_core.simulation_result import LearnerStats, Rejoin, SimulationResult
from diloco_core.syncer import SyncerState, merge_round
from diloco_core.syncer_events import Decide, FinishRun, OpenRound, StopRun

Progress = Callable[[int, int], None]
MAX_TICKS_PER_INSTANT = 64   # each tick opens or decides at most one round: a handful suffice


@dataclass
class _Totals:
    """What the whole run counts: tokens processed, time the global model advanced, bytes up
    and down, tokens that reached a merge."""

    tokens: int = 0
    up_time: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    merged_tokens: int = 0


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
        self.model_def, params = init_model(cfg.model, cfg.seed)
        self.plan = plan_fragments({k: v.shape for k, v in params.items()},
                                   cfg.sync.num_fragments)
        self.inner = InnerStep(self.model_def, cfg.inner, cfg.total_learner_steps)
        self.tx = outer_optimizer_for(cfg)
        self.syncer = SyncerState.start(split_params(params, self.plan), self.tx)
        self.heldout = heldout_data(cfg, heldout_stream)
        self.learners = [
            SimulatedLearner(i, name, speed, np.random.default_rng([cfg.seed, i]),
                     self.inner.init(_copy(params)),
                     LearnerSync.start(name, list(self.syncer.fragments),
                                       list(self.syncer.versions)),
                     learner_data(cfg, i, learner_streams[i]),
                     LearnerStats(name))
            for i, (name, speed) in enumerate(zip(cfg.learners.learner_names,
                                                  cfg.learners.learner_speeds, strict=True))]
        # The syncer's side: its state machine and the rounds it opened.
        self.control = SimulatedSyncer(cfg, Estimates(
            step_seconds=cfg.simulation.step_seconds, sync_seconds=cfg.simulation.sync_seconds))
        self.evals: list[dict] = []
        self.rejoins: list[Rejoin] = []
        self.events = EventQueue()
        self.now = 0.0
        self.totals = _Totals()
        # Evaluate after the first merge past every budget / eval_points tokens, and at the end.
        self.eval_interval_tokens = cfg.token_budget // cfg.simulation.eval_points
        self.next_eval_tokens = self.eval_interval_tokens
        self.finished = False

    # ---- event plumbing -------------------------------------------------------------------
    def _advance_clock(self, t: float) -> None:
        # After STOP nobody trains, and the final rounds are the run's closing, not an outage.
        progressing = sum(1 for lr in self.learners if lr.up and lr.since.blocked is None)
        if self.control.stopping or progressing >= self.cfg.sync.min_quorum:
            self.totals.up_time += t - self.now
        self.now = t

    def _step_seconds(self, learner: SimulatedLearner) -> float:
        sim = self.cfg.simulation
        jitter = 1.0 + sim.step_jitter * learner.rng.standard_normal() if sim.step_jitter else 1.0
        return sim.step_seconds / learner.speed * max(jitter, 0.1)

    def _schedule_step(self, learner: SimulatedLearner, t: float) -> None:
        if learner.since.step is not None or self.control.stopping:
            return  # already stepping (one step chain per learner), or the run is stopping
        learner.since.step = t
        duration = self._step_seconds(learner)
        self.events.push(t + duration, "step", learner.index, learner.generation, duration)

    # ---- the run --------------------------------------------------------------------------
    def run(self) -> SimulationResult:
        if self.cfg.learners.warm_start_fraction:
            self._warm_start()
        for outage in self.cfg.simulation.outages:
            self.events.push(outage.start, "down", outage.learner)
            self.events.push(outage.end, "up", outage.learner)
        for index, (joins, leaves) in self.cfg.capacity_windows().items():
            if joins > 0:   # not here yet: no step, no offer, not live for quorums
                learner = self.learners[index]
                learner.up, learner.joined, learner.since.absent = False, False, 0.0
                # A standby learner without a window never joins; a joining one takes its
                # start-up first, and one that would leave before it is ready never steps.
                ready = joins + self.cfg.simulation.capacity_start_seconds
                if ready < leaves:
                    self.events.push(ready, "join", index)
            if leaves < math.inf:
                self.events.push(leaves, "leave", index)
        for learner in self.learners:
            if learner.up:
                self._schedule_step(learner, self.now)
        while self.events and not self.finished:
            t, kind, payload = self.events.pop()
            self._advance_clock(t)
            getattr(self, f"_on_{kind}")(t, *payload)
        if not self.finished:
            raise RuntimeError("simulation ran out of events before the run finished "
                               "(a learner is down forever and the quorum cannot be met)")
        self.events.clear()
        self._eval(self.now, max(self.control.rounds, default=-1))
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
        while self.totals.tokens < target:
            durations = [self._step_seconds(learner) for learner in self.learners]
            parts = [learner.data.next() for learner in self.learners]
            state, _ = self.inner.step(state, concat_batches(parts))
            step_time = max(durations)
            for learner, duration, part in zip(self.learners, durations, parts, strict=True):
                learner.stats.steps += 1
                learner.stats.tokens += batch_tokens(part)
                learner.stats.busy_seconds += duration
                learner.stats.idle_seconds += step_time - duration
                self.totals.tokens += batch_tokens(part)
            t += step_time
            if self.progress:
                self.progress(self.totals.tokens, self.cfg.token_budget)
        self._advance_clock(t)
        self.syncer = SyncerState.start(split_params(state.params, self.plan), self.tx)
        for learner in self.learners:
            learner.train = TrainState(params=_copy(state.params),
                                       opt_state=_copy(state.opt_state), step=state.step,
                                       tokens=jnp.asarray(learner.stats.tokens, jnp.int32))
            learner.sync = LearnerSync.start(learner.name, list(self.syncer.fragments),
                                             list(self.syncer.versions))
            learner.tokens_at_round_seen = learner.stats.tokens
        # Round 0 waits for H/P steps of progress past the fork, as every later round does.
        self.control.fork({lr.name: lr.stats.tokens for lr in self.learners})
        while self.next_eval_tokens <= self.totals.tokens:
            self.next_eval_tokens += self.eval_interval_tokens

    def _on_step(self, t: float, index: int, generation: int, duration: float) -> None:
        learner = self.learners[index]
        if generation != learner.generation or not learner.up:
            return  # the learner failed during this step (or the run stopped): it is lost
        learner.since.step = None
        batch = learner.data.next()
        learner.train, metrics = self.inner.step(learner.train, batch)
        tokens = batch_tokens(batch)
        learner.sync = learner.sync.after_step(tokens)
        learner.losses.append(metrics["loss"])
        learner.stats.steps += 1
        learner.stats.tokens += tokens
        learner.stats.busy_seconds += duration
        self.totals.tokens += tokens
        if self.progress:
            self.progress(self.totals.tokens, self.cfg.token_budget)
        self._apply_inbox(learner)
        self._boundary(learner, t)

    def _on_down(self, t: float, index: int) -> None:
        learner = self.learners[index]
        if not learner.up:
            return
        self._unblock(learner, t)
        if learner.since.closing is not None:
            learner.stats.closing_seconds += t - learner.since.closing
            learner.since.closing = None
        if learner.since.step is not None:
            learner.stats.lost_seconds += t - learner.since.step
            learner.since.step = None
        if learner.rejoined_at is not None:  # failed again before any merge admitted it
            self.rejoins.append(Rejoin(learner.name, learner.down_at, learner.rejoined_at, None))
            learner.rejoined_at = None
        learner.up = False
        learner.generation += 1
        learner.since.down = learner.down_at = t
        learner.offered.clear()
        learner.inbox.clear()
        self._tick_at(t)      # the live set shrank: a round may now be complete

    def _on_up(self, t: float, index: int) -> None:
        learner = self.learners[index]
        if learner.up or learner.left:
            return
        learner.stats.down_seconds += t - learner.since.down
        peers = [p for p in self.learners if p.up]
        # Rejoin: global parameters from the syncer, AdamW state from the most advanced healthy
        # peer (the learner's own state is stale by the whole outage), its own data position.
        donor = max(peers, key=lambda p: p.stats.steps).train if peers else learner.train
        params = _copy(join_fragments(self.syncer.fragments))
        learner.train = TrainState(params=params, opt_state=_copy(donor.opt_state),
                                   step=donor.step, tokens=learner.train.tokens)
        learner.sync = LearnerSync.start(learner.name, list(self.syncer.fragments),
                                         list(self.syncer.versions))
        learner.up, learner.since.down, learner.rejoined_at = True, None, t
        learner.tokens_at_round_seen = learner.stats.tokens
        if self.control.stopping:
            learner.since.closing = t
        self._boundary(learner, t)

    def _on_join(self, t: float, index: int) -> None:
        """Scavenged capacity arrives: a new learner starts as a rejoining one does (global
        parameters, the most advanced peer's AdamW state and step) on its own shard, which
        nobody has read, so the data stays disjoint."""
        learner = self.learners[index]
        # Absent until its capacity arrived; from then its start-up is down time (the capacity
        # is there and paid for, not training), none without a start-up.
        arrived = t - self.cfg.simulation.capacity_start_seconds
        learner.stats.absent_seconds += arrived - learner.since.absent
        learner.since.absent, learner.since.down = None, arrived
        learner.joined = True
        self._on_up(t, index)
        learner.rejoined_at = None    # a join, not the return of a failed learner

    def _on_leave(self, t: float, index: int) -> None:
        """The capacity is reclaimed: the learner is gone for good, like a failure that never
        ends (its step in progress and its offers in flight are lost), counted as absent."""
        learner = self.learners[index]
        if not learner.up:
            return
        learner.left = True
        self._on_down(t, index)
        learner.since.down, learner.since.absent = None, t

    def _on_deliver(self, t: float, round_index: int, version: int, values: dict | None,
                    members: tuple[str, ...]) -> None:
        self.control.published_merge(round_index, version, members)
        for learner in self.learners:
            if not learner.up:
                continue
            learner.inbox.append((round_index, version, values))
            if values is not None:
                self.totals.bytes_down += sum(int(v.size) * 4 for v in values.values())
            if learner.since.blocked is not None or self.control.stopping:
                self._apply_inbox(learner)
                self._boundary(learner, t)
        self._tick_at(t)

    def _on_tick(self, t: float) -> None:
        self.events.ticked(t)
        self._settle(t)

    # ---- learners at step boundaries --------------------------------------------------------
    def _open_round(self) -> SimulatedRound | None:
        return self.control.open_round()

    def _apply_inbox(self, learner: SimulatedLearner) -> None:
        for round_index, version, values in sorted(learner.inbox, key=lambda d: d[1]):
            if values is not None:
                fragment = self.control.rounds[round_index].fragment
                # The same rule as the real learner's: what each decided round's merge took.
                offered = learner.sync.fragments[fragment].offered_round
                took = {} if offered not in self.control.merged_members else {
                    offered: learner.name in self.control.merged_members[offered]}
                fate = learner.sync.offer_fate(fragment, round_index, took)
                params, learner.sync = learner.sync.receive(
                    learner.train.params, fragment, values, version,
                    self.cfg.sync.receive_rule, self.cfg.sync.blend_alpha, offer=fate)
                learner.train = learner.train.replace(params=params)
            learner.offered.pop(round_index, None)
        learner.inbox.clear()

    def _may_proceed(self, learner: SimulatedLearner) -> bool:
        return not held_by_pacing(learner.stats.steps, list(learner.offered.values()),
                                  learner.stats.tokens - learner.tokens_at_round_seen,
                                  self.cfg.learner_step_tokens[learner.index], self.cfg)

    def _unblock(self, learner: SimulatedLearner, t: float) -> None:
        if learner.since.blocked is not None:
            learner.stats.idle_seconds += t - learner.since.blocked
            learner.since.blocked = None

    def _boundary(self, learner: SimulatedLearner, t: float) -> None:
        """A learner between two steps: it answers the open round if it can, then steps or
        waits; the syncer sees what changed once every event of this instant is in."""
        rnd = self._open_round()
        if rnd is not None:
            self._answer(learner, rnd, t)
        self._proceed(learner, t)
        self._tick_at(t)

    def _proceed(self, learner: SimulatedLearner, t: float) -> None:
        if not learner.up or self.control.stopping:
            return
        if self._may_proceed(learner):
            self._unblock(learner, t)
            self._schedule_step(learner, t)
        elif learner.since.blocked is None:
            learner.since.blocked = t

    def _answer(self, learner: SimulatedLearner, rnd: SimulatedRound, t: float) -> None:
        """The learner's side of the round protocol: offer the round, decline it, or wait (an
        offer of the fragment is in flight, or nothing new yet)."""
        if rnd.decided or learner.name in rnd.answered or not learner.up:
            return
        # Counters run from the last *receipt*, so while an offer of this fragment is in
        # flight (merged or not, not yet received) a second offer would count its steps twice.
        in_flight = any(self.control.rounds[r].fragment == rnd.fragment for r in learner.offered)
        choice = offer_choice(rnd.index, rnd.final, -1,
                              learner.sync.fragments[rnd.fragment].steps, in_flight,
                              stopped=self.control.stopping)
        if choice == "decline":
            rnd.answered.add(learner.name)
            learner.declined.append(rnd.index)
        if choice != "offer":
            return
        contribution = learner.sync.contribution(
            learner.train.params, self.plan, rnd.fragment, rnd.index, learner.stats.steps, t,
            self.cfg.sync.encoding, self.cfg.sync.encoding_block_size)
        self.control.offered(rnd, contribution)
        learner.offered[rnd.index] = learner.stats.steps
        self.totals.bytes_up += contribution.nbytes
        if self.cfg.sync.receive_rule == "rebase":
            learner.sync = learner.sync.after_offer(learner.train.params, self.plan, rnd.fragment,
                                                    rnd.index)

    # ---- the syncer -------------------------------------------------------------------------
    def _tick_at(self, t: float) -> None:
        """Queue a tick of the syncer at `t`, after every event already queued for `t`: the
        syncer sees one instant's heartbeats and offers together, as a poll of the store would
        (and no learner's step event, of several ending at one instant, goes first)."""
        self.events.tick_at(t)

    def _settle(self, t: float) -> None:
        """Tick the syncer's machine at `t` until it has nothing more to do at this instant:
        each tick sees the learners' heartbeats and the offers made since the last, and its
        actions (a round decided or opened, STOP, the end) may make learners answer at once."""
        for _ in range(MAX_TICKS_PER_INSTANT):
            stepped = self.control.tick(t, [lr.view(self.control.stopping)
                                            for lr in self.learners])
            for action in stepped.actions:
                self._act(action, t)
            if stepped.wake_at is not None:
                self._tick_at(stepped.wake_at)
            if not stepped.actions and not self.control.unseen:
                return
            if self.finished:
                return
        raise RuntimeError(f"the syncer's machine did not settle at t={t}")

    def _act(self, action, t: float) -> None:
        if isinstance(action, Decide):
            self._merge(action.decision, t)
        elif isinstance(action, OpenRound):
            rnd = self.control.rounds[action.record.round]
            for learner in self.learners:
                if not learner.up:
                    continue
                learner.tokens_at_round_seen = learner.stats.tokens
                # Learners waiting at a boundary (or done training) answer right away; the
                # others at their next boundary.
                if self.control.stopping or learner.since.blocked is not None:
                    self._answer(learner, rnd, t)
                    self._proceed(learner, t)
        elif isinstance(action, StopRun):
            self._stop(action, t)
        elif isinstance(action, FinishRun):
            self.finished = True

    def _stop(self, action: StopRun, t: float) -> None:
        """STOP: the learners train no more (steps still running are not useful work) and
        answer the open round at once, then the final rounds. (The closing is neither idle
        time nor downtime: the wall time counts it.)"""
        self.control.stopping = True
        self.next_eval_tokens = math.inf  # one eval, after the final rounds
        for learner in self.learners:
            self._unblock(learner, t)
            learner.since.closing = t if learner.up else None
            if learner.up and learner.since.step is not None:
                learner.stats.lost_seconds += t - learner.since.step
                learner.since.step = None
                learner.generation += 1
            # Merges delivered during its last step are applied now, before it answers, as
            # the learner runtime applies what a poll brought before it offers: left queued,
            # an offer of the fragment would stay in flight, and the fragment's final round
            # (which waits for every live learner) would wait its whole timeout for it.
            if learner.up:
                self._apply_inbox(learner)
        rnd = self._open_round()
        if rnd is not None:
            for learner in self.learners:
                self._answer(learner, rnd, t)

    def _merge(self, decision, t: float) -> None:
        rnd = self.control.rounds[decision.round]
        rnd.decided = True
        if not decision.members:       # a final round every learner declined
            return
        contributions = [rnd.contributions[name] for name in decision.members]
        self.syncer, record = merge_round(
            self.syncer, self.plan, rnd.index, rnd.fragment, contributions, self.cfg.sync,
            self.tx, is_embedding, decision.reason, decision.late,
            average=decision.final and self.cfg.outer.final_rounds == "average",
            step_tokens=dict(zip(self.cfg.learners.learner_names,
                                 self.cfg.learner_step_tokens, strict=True)))
        self.control.merges.append(record)
        self.control.merge_times[rnd.index] = t
        self.control.merged_members[rnd.index] = frozenset(record.members if record.merged else ())
        if record.merged:
            self.totals.merged_tokens += sum(record.tokens)
            for learner in self.learners:
                if (learner.name in record.members and learner.rejoined_at is not None
                        and rnd.contributions[learner.name].clock >= learner.rejoined_at):
                    self.rejoins.append(Rejoin(learner.name, learner.down_at, learner.rejoined_at,
                                               t))
                    learner.rejoined_at = None
        values = self.syncer.fragments[rnd.fragment] if record.merged else None
        self.events.push(t + self.cfg.simulation.sync_seconds, "deliver", rnd.index,
                   self.syncer.versions[rnd.fragment], values,
                   tuple(record.members) if record.merged else ())
        if record.merged and self.totals.tokens >= self.next_eval_tokens:
            self._eval(t, rnd.index)

    def _eval(self, t: float, round_index: int) -> None:
        self.next_eval_tokens = self.totals.tokens + self.eval_interval_tokens
        metrics = evaluate(self.model_def, join_fragments(self.syncer.fragments), self.heldout)
        self.evals.append({"time": t, "tokens": self.totals.tokens, "round": round_index,
                           **metrics})

    def _result(self) -> SimulationResult:
        for learner in self.learners:
            if learner.losses:
                learner.stats.train_loss = [float(x) for x in np.asarray(jnp.stack(learner.losses))]
            if learner.since.blocked is not None:
                self._unblock(learner, self.now)
            if learner.up and learner.since.closing is not None:
                learner.stats.closing_seconds += self.now - learner.since.closing
            if not learner.up and learner.since.down is not None:
                learner.stats.down_seconds += self.now - learner.since.down
            if learner.since.absent is not None:
                learner.stats.absent_seconds += self.now - learner.since.absent
        wall = self.now
        processed = self.totals.tokens * self.cfg.sync.num_fragments
        return SimulationResult(
            method=self.method, wall_seconds=wall, tokens_processed=self.totals.tokens,
            evals=self.evals, merges=self.control.merges,
            learners=[lr.stats for lr in self.learners],
            uptime=self.totals.up_time / wall if wall else 1.0, bytes_up=self.totals.bytes_up,
            bytes_down=self.totals.bytes_down,
            merged_token_fraction=self.totals.merged_tokens / processed if processed else 0.0,
            rejoins=self.rejoins, merge_times=self.control.merge_times,
            final_params=join_fragments(self.syncer.fragments))


def run_simulation(cfg: ExperimentConfig, learner_streams: Sequence[np.ndarray],
                   heldout_stream: np.ndarray, method: str = "decoupled",
                   progress: Progress | None = None) -> SimulationResult:
    """Simulate one Decoupled DiLoCo run (or synchronous DiLoCo, given its config)."""
    return Simulation(cfg, learner_streams, heldout_stream, method, progress).run()
