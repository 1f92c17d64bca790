"""The experiments a store holds: every name under `experiments/` that has a config.

Listing the whole `experiments/` prefix would walk every round's contributions and every
checkpoint (thousands of objects in a long run), so a directory store lists only the level
of experiment directories, and a GCS store asks for that level alone (a delimiter listing).
"""

from resources.store import layout
from resources.store.blobs import BlobStore, LocalBlobStore
from resources.store.names import InvalidName, check_name

_PREFIX = "experiments/"


def experiment_names(blobs: BlobStore) -> list[str]:
    """The experiments in `blobs` with a config (one being created has none yet), sorted.
    Directories whose names no experiment may take are skipped."""
    candidates = _children(blobs)
    names = []
    for name in candidates:
        try:
            check_name("experiment", name)
        except InvalidName:
            continue
        if blobs.info(layout.config(name)) is not None:
            names.append(name)
    return sorted(names)


def _children(blobs: BlobStore) -> list[str]:
    if isinstance(blobs, LocalBlobStore):
        top = blobs.root / "experiments"
        return [p.name for p in top.iterdir() if p.is_dir()] if top.is_dir() else []
    from resources.store.gcs_blobs import GCSBlobStore

    if isinstance(blobs, GCSBlobStore):
        root = f"{blobs.prefix}/" if blobs.prefix else ""
        pages = blobs.client.list_blobs(blobs.bucket_name, prefix=root + _PREFIX, delimiter="/",
                                        timeout=blobs.timeout)
        for _ in pages:       # the prefixes are known once the listing has been read
            pass
        return [p[len(root + _PREFIX):].rstrip("/") for p in pages.prefixes]
    # Any other backend: the full listing (bounded by what it holds).
    return sorted({key[len(_PREFIX):].split("/", 1)[0]
                   for key in blobs.list(_PREFIX) if key.endswith("/config.json")})
