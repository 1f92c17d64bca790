"""The Dagster code location: every definition under `pipelines/defs/` is loaded from here."""

import importlib
import pkgutil
import warnings

import dagster as dg

import pipelines.defs

# Modules, not their functions: Dagster refuses a second `@dg.definitions` in this scope.
import pipelines.defs.resources
import pipelines.defs.sensors
from pipelines.alembic_paths import resolve_resource_paths_once

# Before any sensor ticks: each tick opens a Dagster instance, and without this alembic leaks an
# atexit ExitStack each time (pipelines/alembic_paths.py).
resolve_resource_paths_once()


@dg.definitions
def defs() -> dg.Definitions:
    # The defs folder's modules, loaded by Dagster's module loader, plus the two lazy
    # `@dg.definitions` functions (resources and sensors read the environment at load time).
    # Not `dg.load_from_defs_folder`: besides the folder it imports every installed Dagster
    # plugin package to list component types for the UI, and dagster-gcp pulls in BigQuery,
    # pandas and pyarrow (~70 MiB of private memory and ~0.7 s of start) in the code server
    # and in every run worker, one per learner; this project defines no components.
    # `tests/test_definitions.py` checks that both loaders see the same definitions.
    modules = [importlib.import_module(f"{pipelines.defs.__name__}.{info.name}")
               for info in pkgutil.iter_modules(pipelines.defs.__path__)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)  # the loader is "preview" in 1.13
        module_defs = dg.load_definitions_from_modules(modules)
    return dg.Definitions.merge(module_defs, pipelines.defs.resources.resources(),
                                pipelines.defs.sensors.sensors())
