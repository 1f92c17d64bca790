"""The Dagster code location: every definition under `pipelines/defs/` is loaded from here."""

from pathlib import Path

import dagster as dg

import pipelines.defs


@dg.definitions
def defs() -> dg.Definitions:
    # The defs module and the project root given outright, not discovered from a
    # pyproject.toml: an installed package (site-packages) has none.
    return dg.load_defs(pipelines.defs, project_root=Path(__file__).resolve().parent.parent)
