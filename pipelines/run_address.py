"""One address for a run: which store and experiment `status`, `list`, `stop`, `export` and
`capacity` act on, and the commands the demo prints for its run.

The store is `--store`, else $DILOCO_STORE_URI, else the most recently used store under
`runs/` (each demo keeps its own, `runs/demo-<time>/store`; the shared `runs/store` counts
too). The experiment is `--experiment`, else the store's active one, else the store's only
one, so a finished demo (whose ACTIVE was cleared) is still found without a name.

These commands only read (or, for `stop` and `capacity`, write a request into an existing
experiment): a local store that does not exist is an error naming the path, never created
(opening a directory store creates it, which is right for a run and wrong for a typo).
"""

import os
import shlex
from pathlib import Path
from urllib.parse import unquote, urlparse

from resources.store.artifact_store import ArtifactStore, active_experiment
from resources.store.backends import open_blob_store
from resources.store.catalog import experiment_names

RUNS = Path("runs")


class AddressError(Exception):
    """The store or experiment cannot be found: one line saying which and what to do."""


def resolve_store(given: str | None) -> tuple[str, str | None]:
    """The store URI to read, and a note saying where it came from when nobody named it."""
    if given:
        return given, None
    if os.environ.get("DILOCO_STORE_URI"):
        return os.environ["DILOCO_STORE_URI"], None
    found = most_recent_store(RUNS)
    if found is None:
        raise AddressError(f"no store found under {RUNS.resolve()} (run `diloco demo`, or give "
                           "--store DIR or gs://bucket/prefix)")
    return str(found), f"store {found} (the most recent under {RUNS}/; --store picks another)"


def most_recent_store(runs: Path) -> Path | None:
    """The store under `runs` (`runs/store` or `runs/*/store`) that was written to last."""
    candidates = [runs / "store", *sorted(runs.glob("*/store"))] if runs.is_dir() else []
    stores = [p for p in candidates if p.is_dir()]
    return max(stores, key=_last_written, default=None)


def _last_written(store: Path) -> float:
    """When the store last moved: the newest of its ACTIVE pointer, its experiments' directories,
    their open-round pointers and summaries (files that every round or run end rewrites; a
    walk of the whole tree would read thousands of entries)."""
    paths = [store, store / "ACTIVE"]
    for exp in (store / "experiments").glob("*"):
        paths += [exp, exp / "rounds" / "OPEN", exp / "summary.json"]
    times = []
    for path in paths:
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=0.0)


def local_path(uri: str) -> Path | None:
    """The directory of a local store URI (a path or file:///path); None for gs:// and others."""
    if uri.startswith("file://"):
        return Path(unquote(urlparse(uri).path))
    return None if "://" in uri else Path(uri)


def open_existing(uri: str):
    """The blob store at `uri`, refused if it is a local directory that does not exist."""
    path = local_path(uri)
    if path is not None and not path.is_dir():
        reason = "not a directory" if path.exists() else "no such directory"
        raise AddressError(f"no store at {path}: {reason}")
    return open_blob_store(uri)


def choose_experiment(blobs, uri: str, name: str | None) -> ArtifactStore:
    """`name`, else the active experiment, else the only one in the store."""
    if name:
        store = ArtifactStore(blobs, name)
        if store.get_config() is None:
            held = experiment_names(blobs)
            raise AddressError(f"no experiment {name!r} in the store {uri}"
                               + (f" (it holds {', '.join(held)})" if held else " (it is empty)"))
        return store
    active = active_experiment(blobs)
    if active is not None:
        store = ArtifactStore(blobs, active)
        if store.get_config() is None:
            raise AddressError(f"the active experiment {active!r} in the store {uri} has no "
                               "config yet (its `train` run is starting, or failed)")
        return store
    held = experiment_names(blobs)
    if len(held) == 1:
        return ArtifactStore(blobs, held[0])
    if not held:
        raise AddressError(f"no active experiment in the store {uri}, and no other (launch "
                           "the `train` job or `diloco demo`, or give --store)")
    raise AddressError(f"no active experiment in the store {uri}; it holds {len(held)}: "
                       f"{', '.join(held)} (choose one with --experiment; `diloco list` shows "
                       "their states)")


def run_commands(store_uri: str, experiment: str) -> dict[str, str]:
    """The commands that watch, stop and export this run, ready to paste."""
    where = f"--store {shlex.quote(store_uri)} --experiment {shlex.quote(experiment)}"
    return {"status": f"diloco status {where}",
            "stop": f"diloco stop {where}",
            "export": f"diloco export {where} --out EXPORT_DIR"}
