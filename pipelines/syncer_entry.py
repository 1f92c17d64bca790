"""The syncer service's entry point, started by Dagster Pipes (or by hand, without Dagster).

    python -m pipelines.syncer_entry --store runs/store --experiment diloco-demo --attempt 0

Under Pipes the same values come as extras, log lines stream into the Dagster run, and the
final record comes back as a custom message.
"""

import argparse
import signal
import sys

from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

from pipelines.learner_entry import honour_termination, pipes_channel
from pipelines.syncer_service import SyncerService
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store


def main(argv: list[str] | None = None) -> int:
    honour_termination()
    # SIGTERM (a pod deleted, `kill`) ends it like SIGINT: the service gives its lease back
    # on the way out instead of leaving it to go stale.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    under_pipes = PipesEnvVarParamsLoader().is_dagster_pipes_process()
    with open_dagster_pipes(**pipes_channel()) as pipes:
        if under_pipes:
            params = {k: pipes.get_extra(k) for k in ("store", "experiment", "attempt")}
            log = pipes.log.info
        else:
            parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
            parser.add_argument("--store", required=True)
            parser.add_argument("--experiment", required=True)
            parser.add_argument("--attempt", type=int, default=0)
            params = vars(parser.parse_args(argv))

            def log(message: str) -> None:
                print(message, flush=True)
        store = ArtifactStore(open_blob_store(params["store"]), params["experiment"])
        record = SyncerService(store, int(params["attempt"]), log=log).run()
        pipes.report_custom_message(record)
    # A refused or fenced syncer ends cleanly: another one holds the lease.
    return 0


if __name__ == "__main__":
    sys.exit(main())
