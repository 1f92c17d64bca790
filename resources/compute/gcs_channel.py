"""Dagster Pipes over GCS: how a learner anywhere talks to the Dagster run that dispatched it.

The run writes the Pipes context (the run, the learner's extras) to an object in the region's
bucket, and the learner writes its messages (log lines, its stdout and stderr, its final record)
as numbered chunks under a prefix of the same bucket, which the run reads back. Neither side
connects to the other, so it works from any cloud or region that can reach the bucket, through
the same GCS credentials the learner already uses for the store.

The learner side picks the channel from `DILOCO_PIPES_CHANNEL=gcs` (see
`pipelines/learner_entry.py`). A `RemoteProcess` is whatever runs the learner (a local
subprocess standing in for a remote host, or a JobSet on GKE); `run_over_gcs` waits for it and
forwards termination: cancelling the Dagster run stops the learner.
"""

import time
from typing import Protocol

import dagster as dg

from resources.compute.placement import RegionPlacement

CHANNEL_ENV = "DILOCO_PIPES_CHANNEL"
INTERVAL_ENV = "DILOCO_PIPES_INTERVAL"


class RemoteProcess(Protocol):
    def poll(self) -> int | None:
        """None while running, else the exit status (0: success)."""

    def terminate(self) -> None:
        """Stop the learner (it unwinds, writes its final record) and release its compute."""

    def describe(self) -> str:
        """Where it runs, for the run's log."""


class RemoteLauncher(Protocol):
    def __call__(self, env: dict[str, str]) -> RemoteProcess:
        """Start the learner with the Pipes bootstrap environment `env`."""


def gcs_injector_and_reader(placement: RegionPlacement):
    """Dagster's GCS context injector and message reader on the region's bucket. The reader
    also brings back the learner's stdout and stderr."""
    from dagster_gcp.pipes import PipesGCSContextInjector, PipesGCSMessageReader
    from google.cloud import storage

    client = storage.Client()
    return (PipesGCSContextInjector(bucket=placement.bucket, client=client,
                                    key_prefix="diloco-pipes/context-"),
            PipesGCSMessageReader(bucket=placement.bucket, client=client,
                                  interval=placement.pipes_interval_seconds,
                                  include_stdio_in_messages=True))


def channel_env(placement: RegionPlacement, bootstrap: dict[str, str]) -> dict[str, str]:
    """The learner's environment for this channel: Pipes' bootstrap variables (where its
    context is, where to write messages) and the channel's own two settings."""
    return {**bootstrap, CHANNEL_ENV: "gcs", INTERVAL_ENV: str(placement.pipes_interval_seconds)}


# Consecutive failed polls (an API error, a network blip) tolerated before the run gives up on
# the learner; it then stops it, so that no workload keeps a TPU slice without a run watching.
POLL_FAILURES_TOLERATED = 5


def wait_for_exit(process: RemoteProcess, log, poll_seconds: float,
                  failures_tolerated: int = POLL_FAILURES_TOLERATED) -> int:
    """Poll `process` until it exits and return its status. Whatever ends the wait early
    (the run interrupted, polling failing `failures_tolerated + 1` times in a row, any other
    error) stops the process first, then propagates: a learner is never left running on its
    compute with nothing watching it."""
    failures = 0
    try:
        while True:
            try:
                code = process.poll()
            except Exception as err:  # noqa: BLE001 - any API error counts as a failed poll
                failures += 1
                if failures > failures_tolerated:
                    raise
                log.warning(f"[pipes] polling {process.describe()} failed ({err!r}); "
                            f"retrying ({failures}/{failures_tolerated})")
                time.sleep(poll_seconds)
                continue
            failures = 0
            if code is not None:
                return code
            time.sleep(poll_seconds)
    except BaseException as why:
        log.info(f"[pipes] stopping {process.describe()}: {why!r}")
        try:
            process.terminate()
        except Exception as err:  # noqa: BLE001 - report, but raise what ended the wait
            log.error(f"[pipes] could not stop {process.describe()} ({err!r}); delete it by "
                      "hand")
        raise


def run_over_gcs(context: dg.OpExecutionContext, placement: RegionPlacement, extras: dict,
                 launch: RemoteLauncher, poll_seconds: float = 2.0
                 ) -> dg.PipesClientCompletedInvocation:
    """Open a Pipes session whose context and messages travel through `placement.bucket`,
    start the learner with `launch`, and wait for it to end."""
    injector, reader = gcs_injector_and_reader(placement)
    with dg.open_pipes_session(context=context, extras=extras, context_injector=injector,
                               message_reader=reader) as session:
        process = launch(channel_env(placement, session.get_bootstrap_env_vars()))
        context.log.info(f"learner started: {process.describe()} (Pipes over "
                         f"gs://{placement.bucket})")
        code = wait_for_exit(process, context.log, poll_seconds)
        if code != 0:
            raise dg.Failure(description=f"learner {process.describe()} failed with status "
                                         f"{code}")
    return dg.PipesClientCompletedInvocation(session)
