"""`diloco demo`: a complete orchestrated training run on this machine.

The same Dagster definitions as production, served by `dagster dev` on a private DAGSTER_HOME
(webserver + daemon + run queue): the `train` job is launched through the webserver's GraphQL
API, the learner supervisor dispatches one learner process per learner through Dagster Pipes,
the quorum sensor opens and decides rounds and requests merge runs, and the run ends with the
summary asset. This command only launches and watches (reading the store), and with `--chaos`
kills one learner process mid-run (SIGKILL) to show it being relaunched and rejoining, then
the syncer service: its warm standby takes the lease over and carries on until the
supervisor's relaunch takes it in turn (the quorum sensor decides and merges only while no
syncer holds a live lease, e.g. when the syncer was killed before its standby was warm).

With a fault tape, the learners and merges inject their own faults (the train job stores the
tape), and this command plays the orchestrator's part: it restarts the Dagster daemon, the
webserver or the whole instance at the tape's times. Then the instance runs as a production
deployment does (code server, webserver and daemon as separate processes), so that a daemon
or webserver restart leaves the learners running.

With a `postgresql://` URL the instance keeps its runs, event logs and sensor state in that
PostgreSQL database (dagster-postgres) instead of SQLite files in DAGSTER_HOME.
"""

import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_to_mapping
from pipelines.commands import workdir as workdirs
from pipelines.commands.dagster_dev import DagsterDev, check_postgres_url, redact_url
from pipelines.run_address import run_commands
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store
from resources.store.summary_records import Distribution, RunSummary


@dataclass
class Watch:
    """What the demo observed from the store while it ran."""

    started: float = field(default_factory=time.time)
    failures_injected: int = 0
    killed: list[dict] = field(default_factory=list)
    last_line: float = 0.0
    pending: list = field(default_factory=list)  # Dagster faults not fired yet, in time order
    restarts: list[dict] = field(default_factory=list)
    syncer_killed: list[dict] = field(default_factory=list)


def _progress_line(store: ArtifactStore, cfg: ExperimentConfig, watch: Watch) -> str:
    beats = {n: store.get_heartbeat(n) for n in cfg.learners.learner_names}
    tokens = sum(b.tokens_total for b in beats.values() if b is not None)
    latest = store.latest_open_round()
    versions = [store.current_version(p) or 0 for p in range(cfg.sync.num_fragments)]
    evals = None
    r = -1 if latest is None else latest.round
    for back in range(r, max(-1, r - 2 * cfg.sync.num_fragments), -1):
        evals = store.get_eval(back)
        if evals:
            break
    # Statuses in full: cut to five letters, "stopping" and "failed" read "stopp", "faile".
    learners = " ".join(
        f"{n.split('-')[-1]}:down@0" if b is None else
        f"{n.split('-')[-1]}:{b.status}@{b.step}{f'(a{b.attempt})' if b.attempt else ''}"
        for n, b in beats.items())
    loss = f"{evals.loss:.3f}" if evals else "-"
    return (f"[{time.time() - watch.started:6.0f}s] tokens {tokens / cfg.token_budget:6.1%}  "
            f"round {r:>3}  merges {sum(versions):>3}  eval loss {loss}  | {learners}")


def _inject_failure(store: ArtifactStore, cfg: ExperimentConfig, watch: Watch) -> None:
    """Kill one learner process (SIGKILL) once a few merges have happened."""
    merges = sum(store.current_version(p) or 0 for p in range(cfg.sync.num_fragments))
    if watch.failures_injected or merges < 2 * cfg.sync.num_fragments:
        return
    victim = cfg.learners.learner_names[1]
    beat = store.get_heartbeat(victim)
    if beat is None or beat.status != "training" or not beat.pid:
        return
    try:
        os.kill(beat.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    watch.failures_injected += 1
    watch.killed.append({"learner": victim, "pid": beat.pid, "step": beat.step,
                         "at": time.time(), "after_seconds": time.time() - watch.started})
    print(f"chaos: killed {victim} (pid {beat.pid}) at step {beat.step}", flush=True)


def _kill_syncer(store: ArtifactStore, cfg: ExperimentConfig, watch: Watch) -> None:
    """Kill the syncer service (SIGKILL) once the killed learner is back: its warm standby
    takes the lease over at once, then the supervisor's relaunch takes it from the standby;
    without a standby the quorum sensor decides and merges until the relaunch."""
    if (watch.syncer_killed or not watch.failures_injected
            or cfg.orchestration.syncer != "service"):
        return
    merges = sum(store.current_version(p) or 0 for p in range(cfg.sync.num_fragments))
    if merges < 4 * cfg.sync.num_fragments:
        return
    lease = store.get_syncer_lease()
    if lease is None or lease.status != "syncing" or lease.pid is None:
        return
    try:
        os.kill(lease.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    watch.syncer_killed.append({"pid": lease.pid, "attempt": lease.attempt,
                                "at": time.time(), "merges": merges,
                                "after_seconds": time.time() - watch.started})
    print(f"chaos: killed the syncer (pid {lease.pid}) after {merges} merges", flush=True)


def _restart_due(dev: DagsterDev, store: ArtifactStore, watch: Watch, launched: float) -> None:
    """Fire the tape's Dagster restarts whose time (seconds after launch) has come."""
    while watch.pending and time.time() - launched >= watch.pending[0].at_seconds:
        fault = watch.pending.pop(0)
        if not store.mark_fault_fired(fault.id, {"id": fault.id, "kind": fault.kind,
                                                 "time": time.time(), "pid": os.getpid()}):
            continue  # fired by an earlier invocation on this store
        print(f"chaos: {fault.kind} ({fault.id}) at {time.time() - launched:.0f}s", flush=True)
        {"daemon_restart": dev.restart_daemon, "webserver_restart": dev.restart_webserver,
         "instance_restart": dev.restart_instance}[fault.kind]()
        restart = dev.restarts[-1]
        watch.restarts.append({"id": fault.id, "kind": fault.kind, **restart.to_json()})
        print(f"chaos: {fault.kind} done in {restart.seconds:.1f}s "
              f"({restart.reaped_runs} orphaned runs marked failed)", flush=True)


@dataclass(frozen=True)
class DemoReport:
    """What `diloco demo` prints and writes with `--json`: the run's summary, and what the
    demo itself did and saw (wall time, the processes it killed, the restarts it made)."""
    summary: RunSummary
    wall_seconds: float
    watch: Watch
    workdir: str
    stopped_early: dict | None

    def to_json(self) -> dict:
        return {**self.summary.to_json(), "wall_seconds": self.wall_seconds,
                "failures_injected": self.watch.failures_injected,
                "killed": self.watch.killed, "syncer_killed": self.watch.syncer_killed,
                "restarts": self.watch.restarts, "workdir": self.workdir,
                "stopped_early": self.stopped_early}


def run_demo(cfg: ExperimentConfig, *, chaos: bool, json_path: str | None, workdir: str | None,
             port: int | None, timeout: float, store_uri: str | None = None,
             fault_tape_path: str | None = None, postgres_url: str | None = None,
             resume_command: str | None = None) -> int:
    """`resume_command`: what Ctrl-C tells the user to run to resume (default: the demo on the
    same workdir, without the options it was started with)."""
    if postgres_url is not None:
        check_postgres_url(postgres_url)  # a ValueError before anything is created or started
    # Validate the tape here too: its Dagster faults are this command's to execute.
    from resources.chaos.faults import read_tape_file

    tape = (read_tape_file(fault_tape_path, cfg.learners.learner_names)
            if fault_tape_path else None)
    if tape is not None or chaos:
        # Launched as a chaos run: the experiment's config says so, and only then do its
        # processes honour the tape (`resources.chaos.faults.load_tape`).
        cfg = cfg.replace(orchestration=replace(cfg.orchestration, chaos=True))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(workdir or f"runs/demo-{stamp}").resolve()
    workdirs.prepare(root)
    with workdirs.held(root):
        store_uri = store_uri or str(root / "store")
        store = ArtifactStore(open_blob_store(store_uri), cfg.name)
        if _already_finished(store, root, store_uri):
            return 0
        config_path = root / "experiment.yaml"
        try:
            config_path.write_text(yaml.safe_dump(config_to_mapping(cfg), sort_keys=False))
        except OSError as err:
            raise workdirs.WorkdirError(f"cannot write {config_path}: "
                                        f"{workdirs.os_reason(err)}") from None
        resume = resume_command or f"diloco demo --workdir {shlex.quote(str(root))}"
        with _interrupt_says(f"demo: interrupted; resume this run with: {resume}"):
            return _drive(cfg, root, store, store_uri, config_path, chaos=chaos, tape=tape,
                          json_path=json_path, port=port, timeout=timeout,
                          fault_tape_path=fault_tape_path, postgres_url=postgres_url)


def _already_finished(store: ArtifactStore, root: Path, store_uri: str) -> bool:
    """A workdir whose experiment has its summary has nothing left to run: say so (and where
    the run's figures are), rather than start Dagster only to show the old summary again."""
    summary = store.get_summary()
    if summary is None:
        return False
    ended = (store.finished() or {}).get("at")        # the round controller's clock
    when = (time.strftime("%Y-%m-%d %H:%M", time.localtime(ended))
            if isinstance(ended, (int, float)) else "earlier")
    stopped = " (stopped early at an operator's request)" if store.stop_request() else ""
    print(f"demo: experiment {store.experiment} in {root} already finished ({when}){stopped}: "
          f"{summary.outcome.rounds_merged} rounds merged, held-out loss "
          f"{_loss(summary.outcome.initial_eval_loss)} -> "
          f"{_loss(summary.outcome.final_eval_loss)}. Nothing "
          "to run; start a new demo without --workdir (or with a new one).")
    commands = run_commands(store_uri, store.experiment)
    print(f"demo: see it with:    {commands['status']}")
    print(f"demo: export it with: {commands['export']}")
    return True


@contextlib.contextmanager
def _interrupt_says(line: str):
    """Ctrl-C: print `line` at once (before the seconds Dagster takes to stop), then unwind as
    KeyboardInterrupt; a second Ctrl-C while stopping is ignored, so that the shutdown (bounded
    by DagsterDev's grace) is not cut short and leaves no traceback."""
    def on_interrupt(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"\n{line}", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield           # signals reach only the main thread (a driver running this in one)
        return
    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _drive(cfg: ExperimentConfig, root: Path, store: ArtifactStore, store_uri: str,
           config_path: Path, *, chaos: bool, tape, json_path: str | None, port: int | None,
           timeout: float, fault_tape_path: str | None, postgres_url: str | None) -> int:
    """Start the instance, launch `train`, watch the store until the summary, print it."""
    env = {"DILOCO_STORE_URI": store_uri, "DILOCO_ENV": "local",
           "DILOCO_TICK_SECONDS": os.environ.get("DILOCO_TICK_SECONDS", "3"),
           # Every merge run and relaunched learner is a new process: share compiled XLA
           # programs between them instead of compiling the same merge and eval each round.
           "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2"}
    watch = Watch(pending=list(tape.dagster_faults()) if tape else [])
    m = cfg.learners.num_learners
    print(f"demo: {m} learner{'s' if m != 1 else ''}, budget {cfg.token_budget:,} tokens, "
          f"K={cfg.sync.min_quorum}, H={cfg.sync.sync_period}, P={cfg.sync.num_fragments}; "
          f"working in {root}", flush=True)
    print(f"demo: experiment {cfg.name} in the store {store_uri}", flush=True)
    commands = run_commands(store_uri, cfg.name)
    print(f"demo: watch it with:  {commands['status']}", flush=True)
    print(f"demo: stop it with:   {commands['stop']}", flush=True)
    if postgres_url is not None:
        print(f"demo: Dagster instance storage in PostgreSQL at {redact_url(postgres_url)}",
              flush=True)
    with DagsterDev(root / "dagster_home", env=env, port=port,
                    max_concurrent_runs=m + 2 * cfg.sync.num_fragments + 2,
                    split=bool(watch.pending), postgres_url=postgres_url) as dev:
        print(f"demo: Dagster UI at {dev.url} (sensors: quorum_sensor, learner_supervisor)",
              flush=True)
        # The file holds the fully resolved config: no defaults layered under it.
        train = {"config_path": str(config_path), "orchestrated_defaults": False}
        if fault_tape_path:
            train["fault_tape_path"] = str(Path(fault_tape_path).resolve())
        run_id = dev.submit_job("train", {"ops": {"start_experiment": {"config": train}}})
        launched = time.time()
        print(f"demo: launched the train job (run {run_id})", flush=True)
        deadline = time.monotonic() + timeout
        summary = None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                summary = store.get_summary()
                if summary is not None:
                    # Launch to summary: Dagster's shutdown, below, is not the run's time.
                    wall = time.time() - watch.started
                    summary = _recorded_summary(store, summary, deadline)
                    _runs_ended(dev, deadline)
                    break
                if store.get_config() is None:
                    continue
                if chaos:
                    _inject_failure(store, cfg, watch)
                    _kill_syncer(store, cfg, watch)
                _restart_due(dev, store, watch, launched)
                if time.time() - watch.last_line >= 10:
                    print(_progress_line(store, cfg, watch), flush=True)
                    watch.last_line = time.time()
            except (OSError, ValueError) as err:  # a read racing a write: try next time
                print(f"demo: store read failed ({err}); retrying", flush=True)
        if summary is None:
            print(f"demo: no summary after {timeout:.0f}s; stopping (logs in {dev.log_path})",
                  file=sys.stderr)
            return 1
    report = DemoReport(summary=summary, wall_seconds=wall, watch=watch, workdir=str(root),
                        stopped_early=store.stop_request())
    _print_summary(report)
    if json_path:
        Path(json_path).write_text(json.dumps(report.to_json(), indent=2))
        print(f"demo: summary written to {json_path}")
    print(f"demo: see it with:    {commands['status']}")
    print(f"demo: export it with: {commands['export']}")
    return 0


# How long the demo waits, once the summary is recorded, for the runs still in flight to end.
RUNS_END_SECONDS = 30.0


def _runs_ended(dev: DagsterDev, deadline: float) -> None:
    """Wait (at most RUNS_END_SECONDS) for the runs still in flight to end: the `summarize`
    run returns a moment after it recorded the summary, and the learner and syncer runs after
    their processes exit; shutting Dagster down under them ended them as failed runs in the
    instance's history (a `summarize` run interrupted in every demo)."""
    until = min(deadline, time.monotonic() + RUNS_END_SECONDS)
    left: list[str] = []
    while time.monotonic() < until:
        try:
            left = dev.runs_in_flight()
        except (OSError, RuntimeError, ValueError) as err:    # the webserver busy or down
            left = [f"unknown ({err})"]
        if not left:
            return
        time.sleep(0.5)
    print(f"demo: stopping Dagster with runs still in flight: {', '.join(left)}",
          file=sys.stderr)


def _recorded_summary(store, summary: RunSummary, deadline: float) -> RunSummary:
    """The summary once the `summarize` run has recorded it as Dagster's `run_summary` asset
    (the syncer writes it a sensor tick and a run launch earlier): shutting Dagster down
    before would leave the asset missing. Waits at most a minute, then goes on with what the
    syncer wrote."""
    recorded = ArtifactStore.SUMMARY_RECORDED_BY
    until = min(deadline, time.monotonic() + 60.0)
    while summary.summarized_by != recorded and time.monotonic() < until:
        time.sleep(0.5)
        with contextlib.suppress(OSError, ValueError):
            summary = store.get_summary() or summary
    if summary.summarized_by != recorded:
        print("demo: the summarize run did not record the summary within a minute",
              file=sys.stderr)
    return summary


def _stop_line(request: dict) -> str:
    """When, by whom and why an operator ended the run before its token budget."""
    at = request.get("time")
    when = (time.strftime("%H:%M:%S", time.localtime(at)) if isinstance(at, (int, float))
            else "an unknown time")
    reason = request.get("reason") or "no reason given"
    return f"at {when}, requested by {request.get('requested_by') or 'an operator'}: {reason}"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _p90(d: Distribution, digits: int) -> str:
    return "-" if d.p90 is None else f"{d.p90:.{digits}f}"


def _print_summary(report: DemoReport) -> None:
    s = report.summary
    o, t, learners = s.outcome, s.timing, s.learners
    print()
    print(f"rounds merged        {o.rounds_merged} of {o.rounds_opened} opened")
    bits = "-" if o.final_bits_per_byte is None else f"{o.final_bits_per_byte:.3f}"
    print(f"held-out loss        {_loss(o.initial_eval_loss)} -> {_loss(o.final_eval_loss)} "
          f"({bits} bits/byte)")
    budget = "-" if o.token_budget is None else f"{o.token_budget:,}"
    print(f"tokens               {o.tokens:,} (budget {budget})")
    if t.uptime is not None:
        print(f"uptime               {t.uptime:.3f}")
    if learners.learner_idle_fraction is not None:
        print(f"learner idle         {learners.learner_idle_fraction:.1%}")
    lat = t.merge_latency_seconds
    if lat.median is not None:
        print(f"merge latency        median {lat.median:.1f}s, p90 {_p90(lat, 1)}s "
              "(quorum -> published)")
    dec = t.decision_to_publish_seconds
    if dec.median is not None:
        print(f"decision->published  median {dec.median:.3f}s, p90 {_p90(dec, 3)}s")
    # Who decided and merged: the syncer's attempts, its warm standby (syncer-a<n>-standby)
    # after a kill, the sensor's fallback ("sensor") and its merge runs ("run").
    if t.decided_by:
        print(f"decided by           {', '.join(f'{k} {v}' for k, v in t.decided_by.items())}")
    if t.merged_by:
        print(f"merged by            {', '.join(f'{k} {v}' for k, v in t.merged_by.items())}")
    print(f"failures injected    {report.watch.failures_injected}; rejoined: "
          f"{', '.join(learners.learners_rejoined) or 'none'}")
    if s.resilience.faults_fired:
        fired = ", ".join(f"{k} x{v}" for k, v in sorted(s.resilience.faults_fired.items()))
        print(f"faults fired         {fired}")
    if s.capacity.changes:
        print("capacity             " + ", ".join(
            f"{c.learner} {c.action}s (round {c.round})" for c in s.capacity.changes))
    if s.resilience.goodput is not None:
        print(f"goodput              {s.resilience.goodput:.3f} "
              "(tokens merged / learner capacity)")
    ledger = s.ledger
    if ledger is not None:
        lost = ", ".join(f"{k} {v:,.0f}" for k, v in ledger.lost().items())
        print(f"token ledger         {'balanced' if ledger.balanced else 'UNBALANCED'}"
              f"{'' if ledger.exact else ' (inexact: crashed attempts)'}; merged "
              f"{ledger.tokens.get('merged', 0.0):,.0f}; lost: {lost or 'none'}")
    if report.stopped_early:
        print(f"stopped early        {_stop_line(report.stopped_early)}")
    print(f"wall time            {report.wall_seconds:.0f}s")
    print(f"sample               {o.final_sample!r}")
