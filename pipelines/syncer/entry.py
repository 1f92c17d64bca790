"""The syncer service's entry point, started by Dagster Pipes (or by hand, without Dagster).

    python -m pipelines.syncer.entry --store runs/store --experiment diloco-demo --attempt 0

Under Pipes the same values come as extras, log lines stream into the Dagster run, and the
final record comes back as a custom message.

Once its merge and eval programs are compiled, the syncer starts its **warm standby**: the same
module with `--standby-for <its pid>`, a child process that compiles the same programs (from
the persistent compilation cache), then waits on a pipe from the syncer, reading the lease
once a second. The pipe closes only when the syncer's process has ended; if it ended holding
the lease (SIGKILL, a crash, the OOM killer) the standby takes the lease over at once and
carries on. If the syncer is alive but its lease has not moved for
`orchestration.syncer_timeout_seconds` (hung), the standby kills it and takes over the same
way. On a clean exit, or a termination, the syncer ends its standby first.
`DILOCO_SYNCER_STANDBY=0` starts none (the quorum sensor's fallback and the supervisor's
relaunch bridge the gap instead).
"""

import argparse
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys

from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

from pipelines.learner_entry import honour_termination, pipes_channel
from pipelines.syncer.service import SyncerService
from resources.chaos.faults import syncer_faults
from resources.process_log import at_level, stdout_logger
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store


class Standby:
    """The syncer's warm standby process (see the module docstring)."""

    def __init__(self, store: str, experiment: str, attempt: int, log: logging.Logger):
        self.argv = [sys.executable, "-m", "pipelines.syncer.entry", "--store", store,
                     "--experiment", experiment, "--attempt", str(attempt),
                     "--standby-for", str(os.getpid())]
        self.log, self.process = log, None

    @staticmethod
    def wanted() -> bool:
        return os.environ.get("DILOCO_SYNCER_STANDBY", "1") != "0"

    def start(self) -> None:
        # Not a Pipes process: the run's Pipes session belongs to this one.
        env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
        self.process = subprocess.Popen(self.argv, stdin=subprocess.PIPE, env=env)
        self.log.info(f"syncer: warm standby started (pid {self.process.pid})")

    def stop(self) -> None:
        """End the standby (before this syncer gives its lease back: a standby must never
        take over from a syncer that ended cleanly)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()        # SIGTERM: KeyboardInterrupt in the standby
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _parent_ended(seconds: float) -> bool:
    """Whether the syncer that started this standby has ended, waiting at most `seconds`: the
    pipe it holds open as this process's stdin reads EOF only once its process is gone."""
    try:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], seconds)
        return bool(readable) and not os.read(sys.stdin.fileno(), 65536)
    except OSError:
        return True         # no pipe to watch: nothing keeps the standby waiting


def main(argv: list[str] | None = None) -> int:
    honour_termination()
    # SIGTERM (a pod deleted, `kill`) ends it like SIGINT: the service gives its lease back
    # on the way out instead of leaving it to go stale.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    under_pipes = PipesEnvVarParamsLoader().is_dagster_pipes_process()
    with open_dagster_pipes(**pipes_channel()) as pipes:
        if under_pipes:
            params = {k: pipes.get_extra(k) for k in ("store", "experiment", "attempt")}
            log = at_level(pipes.log)
        else:
            parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
            parser.add_argument("--store", required=True)
            parser.add_argument("--experiment", required=True)
            parser.add_argument("--attempt", type=int, default=0)
            parser.add_argument("--standby-for", type=int, default=None,
                                help="stand by for the syncer process with this pid")
            params = vars(parser.parse_args(argv))
            log = stdout_logger("syncer")
        store = ArtifactStore(open_blob_store(params["store"]), params["experiment"])
        # The driver boundary: a chaos run's fault tape, if it has one, hooks into the merges.
        hooks = syncer_faults(store, log)
        parent = params.get("standby_for")
        if parent is not None:
            with contextlib.suppress(KeyboardInterrupt):    # ended by its syncer: not needed
                SyncerService(store, int(params["attempt"]), log=log, standby=True,
                              hooks=hooks).stand_by(
                    parent, _parent_ended, lambda: os.kill(parent, signal.SIGKILL))
            return 0
        standby = (Standby(params["store"], params["experiment"], int(params["attempt"]), log)
                   if Standby.wanted() else None)
        service = SyncerService(store, int(params["attempt"]), log=log, hooks=hooks,
                                on_warm=None if standby is None else standby.start)
        try:
            record = service.run()
        finally:
            if standby is not None:
                standby.stop()
        pipes.report_custom_message(record)
    # A refused or fenced syncer ends cleanly: another one holds the lease.
    return 0


if __name__ == "__main__":
    sys.exit(main())
