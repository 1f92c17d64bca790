"""A chaos run without the Dagster daemon: real learner processes, the real quorum tick and
merge job in-process (`Harness`), and a small supervisor doing what `learner_supervisor` does
(relaunch a dead learner with the next attempt number after a backoff; end a learner whose
heartbeat stopped changing, the way Dagster Pipes forwards a run's termination: SIGINT).

The learners run `python -m pipelines.learner_entry` exactly as Pipes starts them, so kills are
real SIGKILLs of real processes; everything else is driven tick by tick from the test.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from orchestration_harness import Harness

from diloco_core.liveness import observe, silent_for
from pipelines.run_summary import build_summary

REPO = Path(__file__).resolve().parent.parent


class ChaosRun:
    def __init__(self, harness: Harness, store_uri: str, workdir: Path,
                 backoff_seconds: float = 1.0, hang_timeout_seconds: float = 8.0):
        self.h, self.store_uri, self.workdir = harness, store_uri, workdir
        self.backoff, self.hang_timeout = backoff_seconds, hang_timeout_seconds
        self.procs: dict[str, subprocess.Popen] = {}
        self.attempts: dict[str, int] = {}
        self.exited: dict[str, float] = {}
        self.events: list[dict] = []
        self.seen: dict = {}

    def launch(self, name: str) -> None:
        attempt = self.attempts.get(name, -1) + 1
        self.attempts[name] = attempt
        log = open(self.workdir / f"{name}-a{attempt}.log", "wb")  # noqa: SIM115
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS":
               "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
               "JAX_COMPILATION_CACHE_DIR": str(self.workdir / "jax-cache")}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pipelines.learner_entry", "--store", self.store_uri,
             "--experiment", self.h.store.experiment, "--learner", name,
             "--attempt", str(attempt)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.events.append({"event": "launch", "learner": name, "attempt": attempt,
                            "at": time.time()})

    def supervise(self) -> None:
        now = time.time()
        stopping = self.h.store.stop_requested() is not None
        beats = {n: self.h.store.get_heartbeat(n) for n in self.procs}
        self.seen = observe(self.seen, {n: b and b.to_json() for n, b in beats.items()}, now)
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                beat = beats[name]
                silent = silent_for(self.seen, name, now)
                if (beat is not None and beat.attempt == self.attempts[name]
                        and silent is not None
                        and silent > self.hang_timeout):
                    proc.send_signal(signal.SIGINT)
                    self.events.append({"event": "terminated", "learner": name,
                                        "attempt": self.attempts[name], "at": now})
                    self.seen.pop(name, None)
                continue
            if name not in self.exited:
                self.exited[name] = now
                self.events.append({"event": "exit", "learner": name, "code": code,
                                    "attempt": self.attempts[name], "at": now})
            if code != 0 and not stopping and now - self.exited[name] >= self.backoff:
                del self.exited[name]
                self.launch(name)

    def run(self, timeout: float = 400.0) -> dict:
        for name in self.h.cfg.learners.learner_names:
            self.launch(name)
        deadline = time.monotonic() + timeout
        # The supervisor runs on its own thread, as the real one is a separate sensor: a slow
        # tick (in-process merges in a cold environment take seconds) must not delay noticing
        # a hung learner until after the run has finished without it.
        done = threading.Event()

        def supervise_loop() -> None:
            while not done.is_set():
                self.supervise()
                done.wait(0.3)

        supervisor = threading.Thread(target=supervise_loop, daemon=True)
        supervisor.start()
        try:
            while time.monotonic() < deadline:
                result = self.h.tick(real_time=True)
                if self.h.state().get("finished") if self.h.cursor else False:
                    break
                time.sleep(0.3 if result is not None else 0.3)
            else:
                raise TimeoutError(f"the chaos run did not finish in {timeout:.0f}s; logs in "
                                   f"{self.workdir}")
            done.set()
            supervisor.join(30)
            for proc in self.procs.values():
                proc.wait(60)
        finally:
            done.set()
            supervisor.join(30)
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        # As written to the store: the tests check the record's JSON layout too.
        return build_summary(self.h.store, eval_batches=1).to_json()

    def log(self, name: str, attempt: int) -> str:
        return (self.workdir / f"{name}-a{attempt}.log").read_text()
