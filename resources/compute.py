"""Learner compute: where a learner process runs. Locally, a subprocess through Dagster Pipes.

The Dagster run that dispatches a learner stays up for as long as the learner trains; Pipes
streams the learner's log lines into the run's event log and forwards termination (cancelling
the run stops the learner). Each learner process is pinned to one XLA CPU thread by default so
that several learners share a small machine without thrashing.
"""

import os
import sys
from typing import Any

import dagster as dg


class LocalLearnerCompute(dg.ConfigurableResource):
    """Run a learner as `python -m <module>` on this machine, with Dagster Pipes."""

    module: str = "pipelines.learner_entry"
    xla_flags: str = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    extra_env: dict[str, str] = {}

    def launch(self, context: dg.OpExecutionContext, extras: dict[str, Any]
               ) -> dg.PipesClientCompletedInvocation:
        # Two malloc arenas: the learner's few threads do not need one each, and fewer arenas
        # return memory freed after XLA compilation sooner.
        env = {"XLA_FLAGS": self.xla_flags, "PYTHONUNBUFFERED": "1", "MALLOC_ARENA_MAX": "2",
               **self.extra_env}
        client = dg.PipesSubprocessClient(env={**os.environ, **env}, forward_termination=True)
        return client.run(context=context, command=[sys.executable, "-m", self.module],
                          extras=extras)
