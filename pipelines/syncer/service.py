"""The syncer service: one long-lived process per experiment that decides and merges rounds.

Dagster dispatches it like a learner (the `syncer` job, through Pipes and the compute
resource) and supervises it (the learner supervisor relaunches it, and ends it when its lease
stops moving). It is the data plane's other half: learners offer to the store, the syncer
polls the store every `orchestration.syncer_poll_seconds`, decides each round with the round
controller (the same one the quorum sensor runs as a fallback) and merges a decided round at
once, in this process, with the model plan, the outer optimizer and the compiled merge
programs kept warm: decision to published is the merge itself, not a run launch.

- At most one syncer commits: it holds the experiment's lease (`resources.store.lease`),
  renews it every second, and checks it before every commit-point write. A syncer that loses
  it (a newer attempt took over) stops at once without writing.
- A warm standby (`stand_by`, started by the entry point once the syncer's programs are
  compiled) waits beside it, imported and compiled, for its process to end: if it ends
  without giving the lease back (killed, crashed), the standby takes the lease over at once
  and carries on in its place (records say `syncer-a<n>-standby`) until the supervisor's
  relaunch, a newer attempt, takes it from the standby in turn. A syncer alive but hung (its
  lease unmoved for `orchestration.syncer_timeout_seconds`, the sensor's own threshold: a
  merge stuck in a store call, a stalled host) is ended by its standby, which then takes
  over as from a dead one; without a standby the quorum sensor falls back after that timeout
  and the supervisor ends the run after three.
- Everything it decides is written to the store first (round records, decisions, versions),
  so a relaunched syncer, or the quorum sensor while no syncer is live, carries on from the
  store; a round is never decided or merged twice (write-once records, idempotent merges).
- It evaluates the global model every `orchestration.eval_every_rounds` merged rounds (0:
  every P) and stores the result; the quorum sensor mirrors decisions, merges and evals into
  Dagster as asset materializations.
- Once the final rounds are merged it waits for the learners' last processes to end (their
  ledger records are final then) and writes the run summary with its own initial and final
  evals: the summary is there a poll after the run ends, not after a sensor tick, a run launch
  and a fresh process compiling the eval (the `summarize` run records it in Dagster after).
"""

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from diloco_core.config_loading import config_from_mapping
from diloco_core.round_records import RoundDecision
from pipelines.retention import Retention
from pipelines.round_eval import evaluate_global
from pipelines.round_metadata import global_params_metadata, round_scalars
from pipelines.run_summary import build_summary, learners_ended
from pipelines.syncer.hooks import SyncerHooks
from pipelines.syncer.progress import SyncerProgress
from pipelines.syncer.round_control import RoundController
from pipelines.syncer.store_merge import (
    MergeInputError,
    MergeOutcome,
    MergePlan,
    merge_from_store,
    record_unmergeable,
)
from pipelines.syncer.trace import SyncerTrace
from resources.compile_cache import enable_compilation_cache
from resources.metrics_sink import open_sink
from resources.process_memory import release_free_heap
from resources.store.artifact_store import ArtifactStore, Conflict, RejectedArtifact
from resources.store.lease import LeaseLost, LeaseRefused, SyncerLease
from resources.store.lease_record import LeaseRecord
from resources.store.summary_records import Evals, RoundEval

_logger = logging.getLogger(__name__)
PROGRESS_SECONDS = 30.0     # how often a progress line goes to the log (Dagster's run log)


class SyncerService:
    def __init__(self, store: ArtifactStore, attempt: int = 0, log: logging.Logger = _logger,
                 standby: bool = False, on_warm: Callable[[], None] | None = None,
                 hooks: SyncerHooks | None = None):
        config = store.get_config()
        if config is None:
            raise RuntimeError(f"experiment {store.experiment!r} has no config in the store")
        self.store, self.attempt, self.log = store, int(attempt), log
        self.cfg = config_from_mapping(config)
        # Before anything compiles: JAX opens its persistent cache at the first compilation.
        enable_compilation_cache(self.cfg.orchestration.compilation_cache_dir)
        self.name = f"syncer-a{self.attempt}" + ("-standby" if standby else "")  # in records
        self.lease = SyncerLease(store, self.attempt, name=self.name)
        self.on_warm = on_warm     # called once the programs are compiled (starts a standby)
        self.controller = RoundController(
            store, self.cfg, decided_by=self.name, guard=self.lease.check,
            describe_offers=False,
            trace=SyncerTrace.from_env(f"{store.experiment}-{self.name}", store.get_config()))
        self.merge_plan = MergePlan.of(self.cfg)
        # A driver's hooks: a chaos run's faults (`resources.chaos.faults.syncer_faults`).
        self.hooks = SyncerHooks() if hooks is None else hooks
        self.status = "starting"
        self.progress = SyncerProgress()
        self.state: dict | None = None
        self.metrics = open_sink(self.cfg.orchestration.tensorboard_dir, store.experiment,
                                 self.name, log.warning)
        self.retention = Retention.resume(store, self.cfg)
        self._warm: threading.Thread | None = None   # compiles beside the loop (`_run`)

    def run(self, max_seconds: float | None = None) -> dict:
        """Hold the lease and run rounds until the run is finished (or `max_seconds`, for
        tests); returns the final record (status: done, fenced, refused, stopped)."""
        try:
            return self._run(max_seconds)
        finally:
            if self._warm is not None:
                # Never leave XLA compiling on a thread while the interpreter shuts down.
                self._warm.join(timeout=300)
            if self.metrics is not None:
                self.metrics.close()

    def stand_by(self, parent_pid: int, parent_ended: Callable[[float], bool],
                 end_parent: Callable[[], None]) -> dict:
        """The warm standby of the syncer process `parent_pid`: compile, wait until that
        process has ended (`parent_ended(seconds)` blocks at most that long and says whether
        it has), ending it with `end_parent` if it hangs (`_watch`), then take its lease
        over at once if it still holds it, and run the rounds; returns the final record
        (status "not needed" when the syncer gave its lease back or another one holds it)."""
        self.status = "standby"
        self.warm_up()
        self.log.info(f"{self.name}: standing by for the syncer (pid {parent_pid})")
        self._watch(parent_pid, parent_ended, end_parent)
        lease = self.lease.read()
        record = lease.record if lease is not None else LeaseRecord()
        if (self.store.finished() is not None or record.pid != parent_pid
                or record.status != "syncing"):
            self.status = "not needed"
            self.log.info(f"{self.name}: the syncer (pid {parent_pid}) ended; the lease is "
                          f"{record.status} by pid {record.pid}: not taking it")
            return self.record()
        self.log.warning(f"{self.name}: the syncer (pid {parent_pid}) died holding the lease: "
                         "taking it over")
        try:
            return self._run(None, dead_pid=parent_pid)
        finally:
            if self.metrics is not None:
                self.metrics.close()

    def _watch(self, parent_pid: int, parent_ended: Callable[[float], bool],
               end_parent: Callable[[], None]) -> None:
        """Until the syncer `parent_pid` has ended. While it holds the lease, a lease that has
        not moved for the timeout the quorum sensor falls back at means it is alive but hung:
        it is ended (killed: a stalled process must never wake up to write; the lease's
        fencing alone would stop it only at its next check), so that the warm standby takes
        over now instead of the sensor's fallback merges and, three timeouts on, the
        supervisor's cold relaunch."""
        stale_after = self.cfg.orchestration.syncer_timeout_seconds
        watched: tuple[str, float] | None = None
        while not parent_ended(min(1.0, stale_after / 4)):
            try:
                lease = self.lease.read()
            except Exception as err:  # noqa: BLE001 - a failed read must not end the standby
                self.log.warning(f"{self.name}: could not read the lease ({err!r}); retrying")
                watched = None       # judged only on reads that succeed, never on a gap
                continue
            record = None if lease is None else lease.record
            if record is None or record.pid != parent_pid or record.status != "syncing":
                watched = None       # not holding it (yet, or any more): nothing to judge
                continue
            now = time.monotonic()
            if watched is None or watched[0] != record.marker:
                watched = (record.marker, now)
            elif now - watched[1] >= stale_after:
                self.log.warning(f"{self.name}: the syncer (pid {parent_pid}) is alive but has "
                                 f"not renewed its lease for {now - watched[1]:.0f}s: hung; "
                                 "ending it")
                end_parent()
                while not parent_ended(1.0):
                    pass
                return

    def _run(self, max_seconds: float | None, dead_pid: int | None = None) -> dict:
        orch = self.cfg.orchestration
        started = time.monotonic()
        try:
            self.lease.acquire(orch.syncer_timeout_seconds, self.log, dead_pid=dead_pid)
        except LeaseRefused as err:
            self.status = "refused"
            self.log.warning(f"syncer attempt {self.attempt}: refused: {err}")
            return self.record()
        self.log.info(f"syncer attempt {self.attempt} holds the lease (epoch "
                      f"{self.lease.held.record.epoch}); polling every "
                      f"{orch.syncer_poll_seconds}s"
                      + (", compiling the merge and eval programs meanwhile"
                         if self.progress.initial_eval is None else ""))
        self.status = "syncing"
        next_report = time.monotonic() + PROGRESS_SECONDS
        # Rounds open and are decided from the first poll: the programs compile on a thread
        # beside the loop (a merge that needs one first compiles it itself). Compiling first
        # held every round back: 44 s of the 2-core demo with four learners compiling and
        # training beside it (9 s on an idle machine), during which the learners' first 40
        # steps went into round 0.
        if self.progress.initial_eval is None:      # a standby compiled before it took over
            self._warm = threading.Thread(target=self._warm_up_beside_the_loop,
                                          name="syncer-warm-up", daemon=True)
            self._warm.start()
        try:
            while True:
                reason = self.step()
                if self.state.get("finished"):
                    self.status = "done"
                    self.log.info(f"syncer: the run is finished ({self.progress.merged} rounds "
                                  "merged)")
                    self._summarize()
                    break
                if max_seconds is not None and time.monotonic() - started > max_seconds:
                    self.status = "stopped"
                    break
                if time.monotonic() >= next_report:
                    self.log.info(self._progress_line(reason))
                    # The allocator's freed heap, which otherwise grows without bound over a
                    # long run (`resources/process_memory.py`): a few ms every 30 s.
                    release_free_heap()
                    next_report = time.monotonic() + PROGRESS_SECONDS
                time.sleep(orch.syncer_poll_seconds)
        except LeaseLost as err:
            self.status = "fenced"
            self.log.warning(f"syncer attempt {self.attempt}: {err}; exiting without writing")
            return self.record()
        except KeyboardInterrupt:
            # Terminated (Pipes forwards a run's termination as SIGINT; SIGTERM too, see the
            # entry point): give the lease back so the sensor takes over at once.
            self.status = "terminated"
            with contextlib.suppress(LeaseLost, OSError):
                self.lease.release()
            raise
        with contextlib.suppress(LeaseLost, OSError):
            self.lease.release()
        return self.record()

    def _warm_up_beside_the_loop(self) -> None:
        """`warm_up` on its own thread; a failure there only costs the first merges their
        compilation, so it is logged, never raised."""
        try:
            self.warm_up()
        except Exception as err:  # noqa: BLE001 - the loop compiles on demand instead
            self.log.warning(f"syncer: warm-up failed ({err!r}); merges compile on demand")
        if self.on_warm is not None:
            try:
                self.on_warm()
            except Exception as err:  # noqa: BLE001 - the syncer runs on without a standby
                self.log.warning(f"syncer: could not start its standby ({err!r})")

    def step(self, now: float | None = None) -> str:
        """One poll: renew the lease, tick the round controller, merge what it decided,
        evaluate when due. `LeaseLost` (before any write) if another syncer took over."""
        self.lease.renew()
        result = self.controller.tick(self.state, now)
        self.state = result.state
        for decision in result.merges:
            # Several merges in one poll (a hand-over's backlog, a slow store): keep the lease
            # moving between them (at most one write a second).
            self.lease.renew()
            self._merge(decision)
        self._maybe_eval(final=bool(self.state.get("finished")))
        return result.reason

    def warm_up(self) -> None:
        """Compile the merge of every fragment for every number of members (decode, RDA,
        outer step) and the eval, on synthetic contributions: the first real rounds then
        publish in milliseconds instead of waiting on XLA."""
        import jax.numpy as jnp
        import numpy as np

        from diloco_core.compression import encode
        from diloco_core.contribution import Contribution
        from diloco_core.model import is_embedding
        from diloco_core.syncer import FragmentState, all_finite, merge_fragment

        s, plan = self.cfg.sync, self.merge_plan.plan
        started = time.monotonic()
        shapes = self.merge_plan.shapes
        rng = np.random.default_rng(0)
        for p, names in enumerate(plan.fragments):
            params = {n: jnp.zeros(shapes[n], jnp.float32) for n in names}
            members = [Contribution(f"warm-up-{i}", p, 0, 0, 1, 1, 0, 0.0, {
                n: encode(rng.standard_normal(shapes[n]).astype(np.float32) * 1e-3,
                          s.encoding, s.encoding_block_size) for n in names})
                for i in range(self.cfg.learners.num_learners)]
            state = FragmentState(params, 0, self.merge_plan.templates[p], lambda _: None)
            # The merge programs are traced per number of members (1 to M): compile each.
            for count in range(1, len(members) + 1):
                merged, _, _ = merge_fragment(state, names, plan.num_fragments, 0, p,
                                              members[:count], s, self.merge_plan.tx,
                                              is_embedding, "warm-up")
                if merged is not None:
                    all_finite(merged)
        # The eval program compiles on the initial parameters: the summary's first eval.
        self.progress.initial_eval = evaluate_global(self.store, version=0)
        self.log.info(f"syncer: merge and eval programs compiled in "
                      f"{time.monotonic() - started:.1f}s")

    # ---- one round's merge --------------------------------------------------------------------
    def _merge(self, decision: RoundDecision) -> MergeOutcome | None:
        """Merge the round `decision` decided (this process wrote it this tick, or found it in
        the store: the merge need not read it back)."""
        round_index = decision.round
        self.hooks.before_merge(round_index)
        hooks = self.hooks.merge(round_index)
        for attempt in range(3):
            try:
                outcome = merge_from_store(self.store, round_index, hooks, self.merge_plan,
                                           guard=self.lease.check, merged_by=self.name,
                                           decision=decision)
                break
            except Conflict as err:
                # A concurrent merger (a fallback merge run still finishing during a hand-over)
                # committed first: the next try finds its commit.
                self.log.warning(f"round {round_index}: {err}; retrying ({attempt + 1})")
            except MergeInputError as err:
                self.log.error(f"round {round_index} cannot be merged: {err}")
                return None
            except (LeaseLost, OSError):
                # Fenced, or the store itself failing: the supervisor relaunches the syncer
                # and the round is merged then. Never recorded as unmergeable for that.
                raise
            except Exception as err:  # noqa: BLE001 - never crash-loop on one round
                # Every contribution's own problem is refused inside the merge; what still
                # raises would raise again in a relaunched syncer: record the round as not
                # merged, with the error, and go on with the next.
                record_unmergeable(self.store, round_index, err, guard=self.lease.check)
                self.progress.not_merged += 1
                self.log.error(f"round {round_index} NOT merged, the merge raised {err!r}; moving "
                               "on")
                return None
        else:
            self.log.error(f"round {round_index}: gave up after 3 conflicting tries")
            return None
        record = outcome.record
        if outcome.committed and not outcome.already_committed:
            self.progress.merged += 1
            self.progress.merges_since_eval += 1
            latency = record.latency(outcome.decision.decided_at)
            if latency is not None:
                self.progress.decision_to_publish.append(latency)
            if self.metrics is not None:     # after the commit: it never delays a publish
                self.metrics.scalars(round_index, round_scalars(global_params_metadata(
                    self.store, record, outcome.decision, outcome.version, outcome.finite,
                    outcome.seconds)))
            self._prune(outcome.fragment, outcome.version, round_index)
        elif not outcome.committed:
            self.progress.not_merged += 1
            self.log.warning(f"round {round_index} not merged: {record.reason}")
        if record.rejected:
            self.log.warning(f"round {round_index}: rejected {dict(record.rejected)}")
        return outcome

    def _prune(self, fragment: int, version: int, round_index: int) -> None:
        """Retention after a commit. A failure is logged and retried after the next merge of
        the fragment: deleting old arrays must never stop merges."""
        self.lease.check()
        try:
            self.progress.pruned_objects += self.retention.after_merge(fragment, version,
                                                                       round_index)
        except (OSError, Conflict, RejectedArtifact) as err:
            self.log.warning(f"round {round_index}: retention failed, will retry: {err!r}")

    def _maybe_eval(self, final: bool = False) -> None:
        every = self.cfg.orchestration.eval_every_rounds or self.cfg.sync.num_fragments
        done = self.progress.merges_since_eval
        if done == 0 or (not final and done < every):
            return
        self.lease.check()
        result = evaluate_global(self.store)
        self.progress.last_eval = result
        round_index = int(self.state["round"])
        with contextlib.suppress(Conflict):   # a fallback merge run evaluated this round
            self.store.put_eval(round_index, RoundEval(**dict(result), by="syncer"))
        if self.metrics is not None:
            self.metrics.scalars(round_index, {"eval/loss": result.loss,
                                               "eval/bits_per_byte": result.bits_per_byte})
        self.progress.merges_since_eval = 0
        self.progress.last_eval_round = round_index

    def _summarize(self) -> None:
        """Write the run summary once every learner's last process has ended, waiting at most
        the learner timeout (a learner killed after STOP is not relaunched and never says it
        ended). A failure is logged: the `summarize` run the quorum sensor requests builds it
        from the store alone."""
        orch = self.cfg.orchestration
        deadline = time.monotonic() + orch.learner_timeout_seconds + orch.heartbeat_seconds
        try:
            while not learners_ended(self.store, self.cfg) and time.monotonic() < deadline:
                self.lease.renew()
                time.sleep(orch.syncer_poll_seconds)
            if self._warm is not None:      # its eval is the summary's initial eval
                self._warm.join(timeout=300)
            self.lease.check()
            summary = build_summary(self.store, evals=Evals(initial=self.progress.initial_eval,
                                                            final=self.progress.last_eval))
            self.store.put_summary(summary.model_copy(update={"summarized_by": self.name}))
            self.log.info(f"syncer: run summary written (held-out loss "
                          f"{summary.outcome.initial_eval_loss:.3f} -> "
                          f"{summary.outcome.final_eval_loss:.3f})")
        except LeaseLost:
            raise
        except Exception as err:  # noqa: BLE001 - the summarize run writes it instead
            self.log.warning(f"syncer: could not write the run summary ({err!r}); the "
                             "summarize run will")

    # ---- reporting ----------------------------------------------------------------------------
    def _progress_line(self, reason: str) -> str:
        state = self.state
        lat = sorted(self.progress.decision_to_publish[-200:])
        p50 = f"{lat[len(lat) // 2]:.3f}s" if lat else "-"
        return (f"syncer: round {state.get('round')}, {self.progress.merged} merged, "
                f"{self.progress.not_merged} not merged, decision->published p50 {p50}; {reason}")

    def record(self) -> dict:
        lat = sorted(self.progress.decision_to_publish)
        return {"status": self.status, "attempt": self.attempt, "merged": self.progress.merged,
                "not_merged": self.progress.not_merged,
                "decision_to_publish_median": lat[len(lat) // 2] if lat else None,
                "pruned_objects": self.progress.pruned_objects,
                "last_eval_round": self.progress.last_eval_round}
