"""The learner process entry point, started by Dagster Pipes (or by hand, without Dagster).

    python -m pipelines.learner_entry --store runs/store --experiment diloco-demo \
        --learner learner-0

Under Pipes the same values come as extras, log lines stream into the Dagster run, and the
final heartbeat record comes back as a custom message.

A learner on a multi-host slice runs this once per host, each with DILOCO_COORDINATOR,
DILOCO_NUM_PROCESSES and DILOCO_PROCESS_ID set (`resources/learner/distributed.py`); process 0
talks to the store, opens the Pipes session and reports the final record; the others only
train alongside it and log to their own stdout.
"""

import argparse
import os
import signal
import sys
from contextlib import contextmanager

from dagster_pipes import PipesDefaultContextLoader, PipesEnvVarParamsLoader, open_dagster_pipes

from resources.learner.distributed import join_from_env
from resources.process_log import at_level, stdout_logger


def honour_termination() -> None:
    """Make SIGINT raise KeyboardInterrupt, whatever this process inherited.

    Dagster Pipes ends a run's learner with SIGINT, and the learner unwinds on KeyboardInterrupt
    (final ledger record, status "failed"). But a process started under a non-interactive
    shell's background job (`cmd &`, nohup, many CI runners) inherits SIGINT *ignored*, and
    Python then installs no handler: such a learner, hung, could never be ended.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pipes_channel() -> dict:
    """The Pipes context loader and message writer: local files by default; a GCS bucket when
    the run dispatched this learner to another host (`DILOCO_PIPES_CHANNEL=gcs`), so that
    logs, stdout and stderr and the final record travel through objects, not a shared disk."""
    if os.environ.get("DILOCO_PIPES_CHANNEL", "local") != "gcs":
        return {}
    from dagster_pipes import PipesGCSContextLoader, PipesGCSMessageWriter
    from google.cloud import storage

    client = storage.Client()
    interval = float(os.environ.get("DILOCO_PIPES_INTERVAL", "10"))
    return {"context_loader": PipesGCSContextLoader(client=client),
            "message_writer": PipesGCSMessageWriter(client=client, interval=interval)}


LEARNER_EXTRAS = ("store", "experiment", "learner", "attempt")


@contextmanager
def pipes_session(process_id: int):
    """(extras, log, report) for this process of a learner run under Pipes.

    Only process 0 opens the Pipes session: every pod of a multi-host learner gets the same
    Pipes parameters, and each process that opened a session would write its own "opened" and
    "closed" messages and number its message chunks from 0 under the same prefix (the GCS
    channel), overwriting the leader's log lines and final record. The others read the run's
    extras through the same context loader and log to their own stdout (the pod's log)."""
    channel = pipes_channel()
    if process_id == 0:
        with open_dagster_pipes(**channel) as pipes:
            yield ({k: pipes.get_extra(k) for k in LEARNER_EXTRAS}, at_level(pipes.log),
                   pipes.report_custom_message)
        return
    loader = channel.get("context_loader") or PipesDefaultContextLoader()
    with loader.load_context(PipesEnvVarParamsLoader().load_context_params()) as data:
        extras = data.get("extras") or {}
        params = {k: extras[k] for k in LEARNER_EXTRAS}
    yield params, stdout_logger(f"learner-process-{process_id}", f"[process {process_id}] "), \
        lambda record: None


def main(argv: list[str] | None = None) -> int:
    honour_termination()
    # Before anything imports the runtime's modules and touches a JAX backend.
    process_id, _ = join_from_env()
    from resources.chaos.faults import learner_faults
    from resources.learner.runtime import LearnerRuntime
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store

    if PipesEnvVarParamsLoader().is_dagster_pipes_process():
        session = pipes_session(process_id)
    else:
        session = _command_line_session(argv)
    with session as (params, log, report):
        store = ArtifactStore(open_blob_store(params["store"]), params["experiment"])
        attempt = int(params["attempt"])
        # The driver boundary: a chaos run's fault tape, if it has one, hooks into the loop.
        hooks = learner_faults(store, params["learner"], attempt, log)
        runtime = LearnerRuntime(store, params["learner"], attempt, log=log,
                                 use_ocdbt=bool(params.get("use_ocdbt", True)), hooks=hooks)
        report(runtime.run())   # a no-op on processes other than 0 (no Pipes session)
    return 0


@contextmanager
def _command_line_session(argv: list[str] | None):
    """A learner started by hand: its values from the command line, its log on stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--learner", required=True)
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--no-ocdbt", dest="use_ocdbt", action="store_false")
    params = vars(parser.parse_args(argv))
    yield params, stdout_logger("learner"), lambda record: None


if __name__ == "__main__":
    sys.exit(main())
