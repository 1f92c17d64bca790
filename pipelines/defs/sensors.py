"""The syncer's sensors: quorum (rounds, decisions, merges) and learner supervision.

Both are on by default. Their tick interval is `DILOCO_TICK_SECONDS` (default 5), read when the
code location loads. Each tick costs a fixed number of small store reads per learner plus the
new contributions since the last tick; the cursor carries the state between ticks and is
rebuilt from the store if lost.

Each tick ends by handing the allocator's freed heap back to the system: the code server runs
the ticks on gRPC worker threads, and glibc kept what they freed (a 3,000-round haul: Python's
objects and the heap in use flat, the free heap 5.4 -> 20.1 MB in ten minutes; with the release
it stays near 5 MB). `resources/process_memory.py`; a few ms a tick. The code server's growth
has another part not yet located (docs/scale_out.md, "The code server's growth").
"""

import os

import dagster as dg

from pipelines.defs.learners import learner
from pipelines.defs.quorum_tick import quorum_tick
from pipelines.defs.rounds import merge_job
from pipelines.defs.summary import summary_job
from pipelines.defs.supervise_tick import supervise_tick
from pipelines.defs.syncer import syncer
from resources.process_memory import release_free_heap, unmap_large_blocks
from resources.store.resource import ArtifactStoreResource


@dg.definitions
def sensors() -> dg.Definitions:
    interval = int(os.environ.get("DILOCO_TICK_SECONDS", "5"))

    @dg.sensor(name="quorum_sensor", jobs=[merge_job, summary_job],
               minimum_interval_seconds=interval,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Opens rounds, records learner updates, decides each round with "
                           "the K-of-M quorum and adaptive grace window, and requests exactly "
                           "one merge run per round.")
    def quorum_sensor(context: dg.SensorEvaluationContext, store: ArtifactStoreResource):
        unmap_large_blocks()    # once per process: the one that ticks, for weeks
        try:
            return quorum_tick(context, store)
        finally:
            release_free_heap()

    @dg.sensor(name="learner_supervisor", jobs=[learner, syncer],
               minimum_interval_seconds=interval,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Keeps one learner process per learner and one syncer service: "
                           "launches them, relaunches failed or hung ones with exponential "
                           "backoff, records learner checkpoints.")
    def learner_supervisor(context: dg.SensorEvaluationContext, store: ArtifactStoreResource):
        unmap_large_blocks()    # once per process: the one that ticks, for weeks
        try:
            return supervise_tick(context, store)
        finally:
            release_free_heap()

    return dg.Definitions(sensors=[quorum_sensor, learner_supervisor])
