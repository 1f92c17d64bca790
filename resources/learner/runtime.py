"""One learner process: trains continuously, offers fragments, takes merged ones, checkpoints.

The loop never waits for the syncer or for Dagster. Between two inner steps it
- applies any merged fragment the store link downloaded (overwrite, or blend),
- offers its current fragment to a newly opened round (delta against its anchor, counters since
  it last received that fragment), handed to the link thread for upload,
- checkpoints every `checkpoint_every_steps` steps and publishes a heartbeat now and then.
A learner slower than nominal (`learners.speeds` < 1) emulates slower hardware by sleeping
(1/speed - 1) times each step's compute time, and `orchestration.step_seconds_floor` pads every
step to at least floor / speed seconds; the padding counts as compute, not idle. The first step
of a process (XLA compilation) is never padded.
Within its slice the learner is data-parallel over every device JAX sees (`diloco_core/spmd.py`):
each batch is split across them and the state is replicated or FSDP-sharded
(`learners.sharding`); with one device this is the plain single-device step.
Near the end of the budget it pauses at its target in the syncer's forecast (until the next
forecast or STOP: `diloco_core/budget_forecast.py`), so that STOP, which comes a few seconds
after the budget is reached, finds little trained past it.
When the syncer asks to stop (token budget reached) the learner stops training, offers its
progress to the final rounds (one per fragment), and exits. When its capacity is reclaimed
(the capacity record marks it absent: `pipelines/capacity_control.py`) it leaves the same
way: it stops training, offers each fragment it has news on to the rounds that come, and exits
with status "left" (never counted as live meanwhile, so no round waits for it).
On a multi-host slice the learner is several processes of one JAX program (`jax.distributed`,
see `resources/learner/distributed.py`): the mesh spans every process's devices, process 0 (the
leader) alone talks to the store, and once per loop iteration it broadcasts what it saw (round,
merges, stop, its clock; `SharedLink`) so that every process makes the same state transitions
and takes the same jitted steps. Each process draws the same global batch from the same seeded
iterator and hands the mesh only its own rows; checkpoints are saved and restored by every
process, each its own shards (Orbax multi-host).
What it trains and on which mesh: `resources/learner/model.py`; what it reports of itself (its
heartbeats, attempt records and progress lines): `resources/learner/progress.py`.
"""

import contextlib
import dataclasses
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_from_mapping
from diloco_core.learner import FragmentSync, LearnerSync
from diloco_core.learner_protocol import OfferBook
from diloco_core.ledger import AttemptLedger
from diloco_core.round_protocol import tokens_needed
from diloco_core.round_records import RoundOpen
from diloco_core.shards import learner_data
from diloco_core.spmd import host_value, shard_batch
from resources.compile_cache import enable_compilation_cache
from resources.corpus import load_corpus
from resources.learner.beacon import CompileBeacon
from resources.learner.hooks import LearnerHooks
from resources.learner.inherited_offers import as_ints, as_pending, offered_before, offers_in_flight
from resources.learner.lockstep import Lockstep
from resources.learner.model import LearnerModel
from resources.learner.progress import (
    ProcessProgress,
    attempt_record,
    heartbeat_record,
    progress_line,
    ready_beat_due,
)
from resources.learner.restore import plan_restore
from resources.learner.shared_link import SharedLink
from resources.learner.store_link import StoreLink
from resources.store.checkpoints import LearnerCheckpoints
from resources.store.learner_view import LearnerView

_logger = logging.getLogger(__name__)
PROGRESS_SECONDS = 30.0   # how often a progress line goes to the log (Dagster's run log)


class LearnerRuntime:
    def __init__(self, store: LearnerView, learner: str, attempt: int = 0,
                 log: logging.Logger = _logger, use_ocdbt: bool = True,
                 max_steps: int | None = None,
                 hooks: LearnerHooks | None = None):
        config = store.get_config()
        if config is None:
            raise RuntimeError(f"experiment {store.experiment!r} has no config in the store")
        self.cfg: ExperimentConfig = config_from_mapping(config)
        names = self.cfg.learners.learner_names
        if learner not in names:
            raise ValueError(f"learner {learner!r} is not in the experiment ({', '.join(names)})")
        # A driver's hooks (a chaos run's faults) see the store their way (error windows); the
        # ledger's own record goes through the plain store.
        self.hooks = LearnerHooks() if hooks is None else hooks
        self.plain_store = store
        # The processes of this learner (one unless it spans several hosts).
        self.lockstep = Lockstep()
        if self.lockstep.multi and hooks is not None:
            raise ValueError("fault injection is not supported in a multi-process learner")
        store = self.hooks.wrap_store(store)
        self.store, self.name, self.attempt, self.log = store, learner, attempt, log
        self.max_steps = max_steps
        self._paused_at_target = False   # at its budget-forecast target (logged once)
        self.use_ocdbt = use_ocdbt
        cfg = self.cfg
        # Before anything compiles: JAX opens its persistent cache at the first compilation.
        enable_compilation_cache(cfg.orchestration.compilation_cache_dir)
        self.model = LearnerModel.build(cfg, self.index, learner)
        corpus = load_corpus(cfg.data.corpus, cfg.learners.num_learners, cfg.data.heldout_fraction)
        self.data = learner_data(cfg, self.index, corpus.learner_streams[self.index])
        self.checkpoints = LearnerCheckpoints(store.checkpoint_uri(learner), max_to_keep=2,
                                              use_ocdbt=use_ocdbt)
        self.progress = ProcessProgress()
        # What it offered, declined and received (the learner's side of the round protocol):
        # declined rounds are named in its heartbeat so that the syncer stops waiting for it.
        self.book = OfferBook()
        self.ledger = AttemptLedger.start(self.cfg.sync.num_fragments)

    @property
    def index(self) -> int:
        """This learner's place in the experiment's list of learners."""
        return self.cfg.learners.learner_names.index(self.name)

    # ---- start or rejoin ----------------------------------------------------------------------
    def _start_state(self) -> str:
        cfg = self.cfg
        P = cfg.sync.num_fragments
        if self.lockstep.multi:
            fragment_params, versions = self._shared_globals()
        else:
            globals_ = [self.store.load_global(p) for p in range(P)]
            versions = [g.version for g in globals_]
            fragment_params = [dict(g.params) for g in globals_]
        params = {k: jnp.asarray(v) for fp in fragment_params for k, v in fp.items()}
        peers = [n for n in cfg.learners.learner_names if n != self.name]
        # A multi-process learner restores into its mesh's shardings (each process reads its
        # own shards), at the checkpoint step the leader picked.
        restore_args = ({} if not self.lockstep.multi else
                        {"target": self.model.sharded_target(), "agree": self._leaders_step,
                         "leader": self.lockstep.leader})
        plan = plan_restore(self.store, self.name, peers, self.model.template, versions,
                            cfg.orchestration.rejoin_max_versions_behind, self.use_ocdbt,
                            inner_opt=cfg.inner, **restore_args)
        answered = -1       # the newest round it offered or declined
        if plan.source == "own":
            meta = plan.meta
            self.train = plan.state["train"]
            self.sync = LearnerSync(self.name, tuple(
                FragmentSync(dict(a), v, s, t) for a, v, s, t in zip(
                    plan.state["anchors"], meta["versions"], meta["fragment_steps"],
                    meta["fragment_tokens"], strict=True)))
            self.data.restore(meta["data"])
            answered = meta["last_offered"]
        else:
            self.train = self.model.inner.init(params)
            if plan.source == "peer":
                peer_train = plan.state["train"]
                self.train = self.train.replace(opt_state=peer_train.opt_state,
                                                step=peer_train.step)
            own = (plan.meta or {}).get("own")
            if own is not None:
                self.data.restore(own["data"])
            self.sync = LearnerSync.start(self.name, fragment_params, versions)
        # Tokens this learner processed over all its attempts (lost ones included): the syncer
        # stops the run when the learners' totals reach the budget.
        # Never offer a round twice (offers are write-once): a relaunched learner may already
        # have offered the round open now, and its earlier offers awaiting a merge stay in flight.
        inherited = [-1] * (2 * P)
        if self.lockstep.leader:
            latest = self.store.latest_open_round()
            if latest is not None and offered_before(self.store, self.name, latest.round):
                answered = max(answered, latest.round)
            previous = self.store.get_heartbeat(self.name)
            self.tokens_total = 0 if previous is None else previous.tokens_total
            inherited = as_ints(offers_in_flight(
                self.store, self.name, None if latest is None else latest.round,
                [f.version for f in self.sync.fragments], self.log), P)
        else:
            self.tokens_total = 0
        answered, self.tokens_total, *inherited = self.lockstep.ints(
            [answered, self.tokens_total, *inherited])
        # Their wait is timed from the start of the loop, on the link's clock (`run`).
        self.book = OfferBook(answered=answered, pending=as_pending(
            inherited, int(self.train.step), since=0.0))
        self._place_state()
        return f"{plan.source}: {plan.reason}"

    def _shared_globals(self) -> tuple[list[dict], list[int]]:
        """The current global fragments, read by the leader and broadcast to every process."""
        shapes = self.model.fragment_shapes()
        if self.lockstep.leader:
            globals_ = [self.store.load_global(p) for p in range(len(shapes))]
            versions = [g.version for g in globals_]
            values = [{k: np.asarray(v, dtype=shapes[p][k][1]) for k, v in g.params.items()}
                      for p, g in enumerate(globals_)]
        else:
            versions = [0] * len(shapes)
            values = [{k: np.zeros(shape, dtype) for k, (shape, dtype) in s.items()}
                      for s in shapes]
        return self.lockstep.arrays(values), self.lockstep.ints(versions)

    def _leaders_step(self, step: int | None) -> int | None:
        """The checkpoint step the leader found (None: none), for every process."""
        agreed = self.lockstep.ints([-1 if step is None else step])[0]
        return None if agreed < 0 else agreed

    def _now(self, local: float | None = None) -> float:
        """The clock that times rounds and stops: this process's, or in a multi-process learner
        the leader's as of this loop iteration (all processes then time out together)."""
        if self.lockstep.multi:
            return self.link.now
        return time.monotonic() if local is None else local

    def _place_state(self) -> None:
        """Put the train state and the anchors on the mesh (arrays already there stay put).
        Anchors are placed like the params so that, under FSDP, no device holds a full extra
        copy of the model and the offer's delta (anchor - theta) is computed shard by shard."""
        self.train = self.model.place(self.train)
        self.sync = dataclasses.replace(self.sync, fragments=tuple(
            dataclasses.replace(f, anchor=self.model.place(f.anchor))
            for f in self.sync.fragments))

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, orch = self.cfg, self.cfg.orchestration
        progress = self.progress
        progress.rejoined_from = self._start_state()
        self.log.info(f"{self.name} (attempt {self.attempt}) starting from "
                      f"{progress.rejoined_from}")
        self.log.info(self.model.describe(self.name))
        if self.lockstep.multi:
            # Only the leader links to the store; every process sees its view (SharedLink).
            link = (StoreLink(self.store, self.name, cfg.sync.num_fragments,
                              [f.version for f in self.sync.fragments], orch.poll_seconds,
                              self.log, self.attempt, cfg.learners.standby_names)
                    if self.lockstep.leader else None)
            self.link = SharedLink(link, self.lockstep, self.model.fragment_shapes())
        else:
            self.link = StoreLink(self.store, self.name, cfg.sync.num_fragments,
                                  [f.version for f in self.sync.fragments], orch.poll_seconds,
                                  self.log, self.attempt, cfg.learners.standby_names)
        self.book = dataclasses.replace(self.book, pending={   # inherited: they wait from now
            r: dataclasses.replace(p, since=self._now()) for r, p in self.book.pending.items()})
        progress.status = "training"
        self._beat()
        next_beat = time.monotonic() + orch.heartbeat_seconds
        next_report = time.monotonic() + PROGRESS_SECONDS
        final_offered: set[int] = set()
        needed = tokens_needed(cfg)[self.name]
        beaten_for: int | None = None   # the round this learner last beat as ready to follow
        stop_seen_at: float | None = None
        leaving = False     # capacity reclaimed: it offers what it has, then exits
        progress.loop_started = time.monotonic()
        try:
            while True:
                if self.lockstep.multi:
                    self.link.sync()   # this iteration's view of the store, the same everywhere
                if self.link.superseded_by is not None:
                    progress.status = "superseded"
                    self.log.warning(f"{self.name} attempt {self.attempt}: attempt "
                                     f"{self.link.superseded_by} has started; exiting")
                    break
                # The round before the merges: a poll queues both at once, so a merge published
                # before the round opened is applied before it is offered (`inherited_offers`).
                rnd, stop = self.link.open_round, self.link.stop
                self._apply_merged()
                offered = self._maybe_offer(rnd, stopped=stop is not None)
                if offered is not None and offered.final:
                    final_offered.add(offered.fragment)
                if stop is not None:
                    if stop_seen_at is None:
                        seen_here = time.monotonic()
                        stop_seen_at = self._now(seen_here)
                        progress.training_seconds = seen_here - progress.loop_started
                        leaving = bool(stop.get("leave"))
                        progress.status = "leaving" if leaving else "stopping"
                        self.log.info(f"{self.name}: " + (
                            f"leaving ({stop.get('reason')}); offering what it has to the "
                            "coming rounds" if leaving else
                            f"stop requested ({stop.get('reason')}); offering the final "
                            "rounds"))
                        self._checkpoint()
                        self._beat()
                    done = (all(self._nothing_left_to_offer(p)
                                for p in range(cfg.sync.num_fragments)) if leaving
                            else len(final_offered) == cfg.sync.num_fragments)
                    timed_out = (self._now() - stop_seen_at
                                 > orch.round_timeout_seconds * cfg.sync.num_fragments)
                    if done or timed_out:
                        break
                    time.sleep(orch.poll_seconds / 2)
                elif ((self.max_steps is not None and int(self.train.step) >= self.max_steps)
                      or self._must_wait(rnd) or self._at_budget_target(rnd)):
                    time.sleep(orch.poll_seconds / 4)
                else:
                    self._step()
                    if int(self.train.step) % orch.checkpoint_every_steps == 0:
                        self._checkpoint()
                # Only the leader's beat is written (SharedLink), and only before STOP.
                ready = (None if stop_seen_at is not None or not self.lockstep.leader
                         else ready_beat_due(
                    self.link.open_round, self.name, self.tokens_total, needed, beaten_for))
                if ready is not None or time.monotonic() >= next_beat:
                    self._note_durable_checkpoint()
                    self._beat()
                    next_beat = time.monotonic() + orch.heartbeat_seconds
                    beaten_for = beaten_for if ready is None else ready
                if time.monotonic() >= next_report:
                    self.log.info(progress_line(self))
                    next_report = time.monotonic() + PROGRESS_SECONDS
            if progress.status != "superseded":
                progress.status = "left" if leaving else "done"
        except BaseException:
            progress.status = "failed"   # not "training": the syncer must not count it as live
            raise
        finally:
            if stop_seen_at is None:
                progress.training_seconds = time.monotonic() - progress.loop_started
            if progress.status != "superseded":
                self._finish_checkpoint()
                self._beat(final=True)
            elif self.lockstep.leader:
                self._final_record("superseded")
            self.link.close()
            self.checkpoints.close()
        return self.heartbeat_record()

    def _step(self) -> None:
        self.hooks.before_step(int(self.train.step), self._final_record)
        batch = self.data.next()
        started = time.monotonic()
        # Host-to-device copy of the batch, split across the mesh: counted as compute, as it
        # was when the jitted step copied a host batch itself.
        device_batch = shard_batch(batch, self.model.mesh)
        orch = self.cfg.orchestration
        # This process's first step compiles the step program: keep heartbeats going.
        beacon = (CompileBeacon(self.link.heartbeat, self.heartbeat_record(),
                                orch.heartbeat_seconds, orch.compile_timeout_seconds, self._clock)
                  if self.progress.steps == 0 else contextlib.nullcontext())
        with beacon:
            self.train, metrics = self.model.inner.step(self.train, device_batch)
            # Syncs: the step's compute is done when this returns.
            loss = float(host_value(metrics["loss"]) if self.lockstep.multi else metrics["loss"])
        elapsed = time.monotonic() - started
        if self.progress.steps > 0:
            slowdown = self.hooks.slowdown(int(self.train.step))
            speed = self.cfg.learners.learner_speeds[self.index] / slowdown
            target = max(elapsed, self.cfg.orchestration.step_seconds_floor) / speed
            if target > elapsed:
                time.sleep(target - elapsed)
        self.progress.steps += 1
        self.progress.compute_seconds += time.monotonic() - started
        if not math.isfinite(loss):
            raise FloatingPointError(f"{self.name}: training loss is {loss} at step "
                                     f"{int(self.train.step)}")
        self.progress.last_loss = loss
        tokens = self.model.inner.tokens_per_batch(batch)
        self.tokens_total += tokens
        self.sync = self.sync.after_step(tokens)
        self.ledger = self.ledger.after_step(tokens)

    def _apply_merged(self) -> None:
        s = self.cfg.sync
        for p, arrival in sorted(self.link.take_merged().items()):
            before = self.sync.fragments[p]
            # Under rebase, a merge that did not take this learner's pending offer (late, not
            # admitted, refused) must not drop what it offered.
            fate = self.sync.offer_fate(p, arrival.merged_round, arrival.merged_with,
                                        arrival.complete)
            params, self.sync = self.sync.receive(self.train.params, p, arrival.values,
                                                  arrival.version, s.receive_rule,
                                                  s.blend_alpha, offer=fate)
            if self.sync.fragments[p].version == before.version:
                continue  # not newer than what it holds
            self.train = self.train.replace(params=params)
            # The fragment's new params and anchor arrive on one device: put them on the mesh.
            self._place_state()
            if fate == "not_merged" and before.offered_round is not None:
                self.ledger = self.ledger.returned_claim(p, before.offered_round)
            # An earlier round's merge ("pending") does not answer the offer: it stays in
            # flight (a second offer now would carry its progress, and its tokens, twice).
            self.book = self.book.received_merge(p, self.sync.fragments[p].version,
                                                  arrival.merged_round, fate)
            self.ledger = self.ledger.received(p, keeps_local=s.receive_rule == "rebase")

    def _maybe_offer(self, rnd: RoundOpen | None, stopped: bool) -> RoundOpen | None:
        if rnd is None:
            return None
        p = rnd.fragment
        # The protocol's offer rule: counters run from the last receipt of the fragment, so
        # while an offer of it awaits its merge a second offer would count its tokens twice.
        self._settle()
        choice = self.book.choice(rnd.round, p, rnd.final,
                                  self.sync.fragments[p].steps, stopped=stopped)
        if choice in ("answered", "wait"):
            return None
        if choice == "decline":
            self.book = self.book.declined_round(rnd.round)
            self._beat()
            return rnd
        s = self.cfg.sync
        contribution = None
        if not self.lockstep.multi:
            contribution = self.sync.contribution(self.train.params, self.model.plan, p,
                                                  rnd.round, int(self.train.step),
                                                  self._clock(), s.encoding,
                                                  s.encoding_block_size)
        else:
            # The delta from host values: under FSDP every process takes part in gathering
            # them (a collective); the leader alone encodes and uploads the offer.
            names = self.model.plan.fragments[p]
            params = {k: host_value(self.train.params[k]) for k in names}
            anchor = {k: host_value(self.sync.fragments[p].anchor[k]) for k in names}
            if self.lockstep.leader:
                fragments = list(self.sync.fragments)
                fragments[p] = dataclasses.replace(fragments[p], anchor=anchor)
                contribution = dataclasses.replace(self.sync, fragments=tuple(fragments)
                                                   ).contribution(
                    params, self.model.plan, p, rnd.round, int(self.train.step), self._clock(),
                    s.encoding, s.encoding_block_size)
        if s.receive_rule == "rebase":
            self.sync = self.sync.after_offer(self.train.params, self.model.plan, p, rnd.round)
        self.ledger, claim = self.ledger.offered(p, rnd.round)
        self.book = self.book.offered(rnd.round, p, self.sync.fragments[p].version,
                                      int(self.train.step), self._now())
        extra = {"train_loss": self.progress.last_loss, "attempt": self.attempt, "claim": claim}
        contribution, after_put, marks = self.hooks.offer(contribution, rnd.round)
        extra.update(marks)
        self.link.offer(contribution, extra, after_put, record=self.attempt_record())
        return rnd

    def _nothing_left_to_offer(self, fragment: int) -> bool:
        return self.book.nothing_left_to_offer(fragment, self.sync.fragments[fragment].steps,
                                               int(self.train.step))

    def _settle(self) -> None:
        """Drop the offers whose merge has come back (or that waited out the round timeout)."""
        self.book = self.book.settle([f.version for f in self.sync.fragments], self._now(),
                                     self.cfg.orchestration.round_timeout_seconds)

    def _at_budget_target(self, rnd: RoundOpen | None) -> bool:
        """Near the end of the budget: paused at this learner's target in the syncer's
        forecast (`diloco_core/budget_forecast.py`) until a newer forecast or STOP. It beats on
        pausing, so that the syncer counts the total it paused at without waiting a heartbeat
        period for it."""
        target = self.link.pause_target
        paused = (target is not None and self.tokens_total >= target
                  and not self._round_waits_for_a_step(rnd))
        if paused and not self._paused_at_target:
            self.log.info(f"{self.name}: at its share of the token budget ({self.tokens_total} "
                          f">= {target} tokens); waiting for the syncer's count")
            self._beat()
        self._paused_at_target = paused
        return paused

    def _round_waits_for_a_step(self, rnd: RoundOpen | None) -> bool:
        """The open round is this learner's to answer but it has nothing to offer on its
        fragment (received since its last step: the offer rule waits for the next step). Before
        STOP a round waits for a quorum of offers, not for declines, so a learner paused at its
        budget target takes that one step: paused through it, it could hold the round, and the
        credit the syncer's count waits on, until its pause ran out."""
        if rnd is None:
            return False
        p = rnd.fragment
        return (rnd.round > self.book.answered and not self.book.in_flight(p)
                and self.sync.fragments[p].steps < 1)

    def _must_wait(self, rnd: RoundOpen | None) -> bool:
        """Pacing (`sync.block_on_overlap`): the protocol's rule, as in the simulator. `rnd`:
        the open round this loop iteration offered to, not a newer read of the link (its poll
        runs beside the loop): a round that opened after the offer check would otherwise end
        the wait "for a round" and let a step run before the offer."""
        if not self.cfg.sync.block_on_overlap:
            return False
        self.book = self.book.saw_round(-1 if rnd is None else rnd.round, self.tokens_total)
        self._settle()
        return self.book.must_wait(int(self.train.step), self.tokens_total,
                                   self.cfg.learner_step_tokens[self.index], self.cfg)

    def _checkpoint(self) -> None:
        if self.link.fenced():
            self.log.warning(f"{self.name} attempt {self.attempt}: not checkpointing, attempt "
                             f"{self.link.superseded_by} has replaced it")
            return
        step = int(self.train.step)
        meta = {"learner": self.name, "step": step, "tokens_total": self.tokens_total,
                "data": self.data.state(), "versions": [f.version for f in self.sync.fragments],
                "fragment_steps": [f.steps for f in self.sync.fragments],
                "fragment_tokens": [f.tokens for f in self.sync.fragments],
                "last_offered": self.book.answered}
        state = {"train": self.train, "anchors": [f.anchor for f in self.sync.fragments]}
        # A save blocks the loop until it is durable (minutes for a large model on GCS): keep
        # heartbeats going meanwhile, or the supervisor would end the learner as hung. Bounded
        # like the compile's, so a save that truly hangs still goes silent.
        orch = self.cfg.orchestration
        with CompileBeacon(self.link.heartbeat, self.heartbeat_record(), orch.heartbeat_seconds,
                           orch.compile_timeout_seconds, self._clock, status=self.progress.status,
                           doing="checkpointing"):
            # One process: host copies, written in the background unless async checkpoints
            # are off. Several: the global arrays themselves, each process writing the shards
            # it holds (Orbax multi-host; a host copy of an FSDP array would need a gather,
            # and every process would write the whole state), blocking until durable.
            if self.lockstep.multi:
                self.checkpoints.save(step, state, meta)
            else:
                self.checkpoints.save(step, jax.device_get(state), meta,
                                      wait=not orch.async_checkpoints)
        self._note_durable_checkpoint()

    def _note_durable_checkpoint(self, wait: bool = False) -> None:
        """Report only a checkpoint that is written: the newest durable step (a background
        save still in flight is not one yet)."""
        step = self.checkpoints.wait() if wait else self.checkpoints.poll()
        if step is not None:
            self.progress.checkpoint_step = step

    def _finish_checkpoint(self) -> None:
        """Before the final heartbeat: the save in flight finishes, so the record names the
        newest checkpoint. A failed write is logged, not raised over the loop's own outcome."""
        try:
            self._note_durable_checkpoint(wait=True)
        except Exception as err:  # noqa: BLE001 - the loop's own exception, if any, comes first
            self.log.error(f"{self.name}: the last checkpoint save failed: {type(err).__name__}: "
                           f"{str(err)[:200]}")

    def heartbeat_record(self) -> dict:
        return heartbeat_record(self)

    def _clock(self) -> float:
        return self.hooks.clock()

    def attempt_record(self, final: bool = False, status: str | None = None) -> dict:
        """This process's token ledger; `final` once nothing more can change it."""
        return attempt_record(self, final, status)

    def _final_record(self, status: str) -> None:
        """Written synchronously (an injected kill follows): the exact ledger of this process."""
        self.plain_store.put_attempt_record(self.name, self.attempt,
                                            self.attempt_record(final=True, status=status))

    def _beat(self, final: bool = False) -> None:
        self.link.heartbeat(self.heartbeat_record(), self.attempt_record(final))
