"""A learner on this machine: a subprocess of the Dagster run.

With the local channel (the default) this is Dagster's own `PipesSubprocessClient`: the context
and messages pass through temporary files, and log lines stream into the run. With the GCS
channel the same subprocess stands in for a remote host: it talks to the run only through the
bucket, exactly as a learner on a TPU slice in another region does.

Each learner process is pinned to one XLA CPU thread by default so that several learners share a
small machine without thrashing.
"""

import contextlib
import os
import signal
import subprocess
import sys

import dagster as dg

DEFAULT_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
LEARNER_MODULE = "pipelines.learner_entry"
SYNCER_MODULE = "pipelines.syncer.entry"


def local_env(xla_flags: str, extra_env: dict[str, str]) -> dict[str, str]:
    # Two malloc arenas: the learner's few threads do not need one each, and fewer arenas
    # return memory freed after XLA compilation sooner.
    return {"XLA_FLAGS": xla_flags, "PYTHONUNBUFFERED": "1", "MALLOC_ARENA_MAX": "2",
            **extra_env}


def run_local(context: dg.OpExecutionContext, extras: dict, env: dict[str, str],
              module: str = LEARNER_MODULE) -> dg.PipesClientCompletedInvocation:
    """Pipes through local files: Dagster's subprocess client, termination forwarded."""
    client = dg.PipesSubprocessClient(env={**os.environ, **env}, forward_termination=True)
    return client.run(context=context, command=[sys.executable, "-m", module], extras=extras)


class LocalProcess:
    """A learner subprocess driven through a remote channel (`gcs_channel.RemoteProcess`)."""

    def __init__(self, env: dict[str, str], module: str = LEARNER_MODULE,
                 grace_seconds: float = 60.0):
        self.grace_seconds = grace_seconds
        self.process = subprocess.Popen([sys.executable, "-m", module],
                                        env={**os.environ, **env}, stdin=subprocess.DEVNULL)

    def poll(self) -> int | None:
        return self.process.poll()

    def terminate(self) -> None:
        # SIGINT first: the learner unwinds and writes its final record, as under Pipes.
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(self.grace_seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def describe(self) -> str:
        return f"local process {self.process.pid}"
