"""Alembic's package-resource paths, resolved once per process: the code server's memory leak.

Dagster checks its SQLite schema with alembic whenever it opens an instance from a reference,
and a sensor evaluation opens one every tick (Dagster builds the sensor's resources with it), in
the code server. Alembic (1.20) resolves its script location, a package resource
(`dagster:_core/storage/alembic`), through `alembic.util.coerce_resource_to_filename`, which
registers a new `ExitStack` with `atexit` on every call and never closes it before the process
exits: two more per tick (the run and schedule storages), about 5 KB
(`benchmarks/sensor_instance_memory.py`): about 5 GB a month at the default 5 s tick, since it
follows the ticks, not the rounds. (Part of the code server's growth in the long haul, not all:
docs/scale_out.md, "The code server's growth".)

A resource's path does not change while the process lives (for a file on disk it is the file;
for a zipped package, a temporary copy alembic keeps until exit anyway), so resolving each
resource once returns what alembic would have: the one `ExitStack` kept per resource is closed
at exit as before. Applied when the code location loads (`pipelines/definitions.py`).
"""

import functools

import alembic.util


def resolve_resource_paths_once() -> None:
    """Make alembic resolve each package resource once per process (idempotent)."""
    resolve = alembic.util.coerce_resource_to_filename
    if hasattr(resolve, "cache_info"):      # already applied (a reload of the code location)
        return
    # Alembic's script directory looks the function up on `alembic.util` at each call.
    alembic.util.coerce_resource_to_filename = functools.lru_cache(maxsize=64)(resolve)
