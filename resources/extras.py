"""The optional dependency groups (pyproject extras) and the one-line error when one is missing.

A laptop install (`pip install decoupled-diloco`) trains, orchestrates and tests on a local
store; the cloud and production pieces are extras, so that it does not carry hundreds of MB of
client libraries it never uses:

- `gcp`: a `gs://` store, learners on remote hosts or GKE talking Pipes through a bucket;
- `k8s`: learners placed on GKE TPU node pools (`diloco manifests` too);
- `postgres`: a Dagster instance on PostgreSQL (`diloco demo --postgres-url`);
- `digits`: the vision task on scikit-learn's digits images;
- `plots`: matplotlib, for the PNG plots of `diloco simulate`, `goodput`, `bandwidth` and the
  `goodput_at_scale` asset (without it they print or record their figures and skip the plot);
- `tensorboard`: the TensorBoard app, to view the event files `orchestration.tensorboard_dir`
  gets (writing them needs nothing more than the base install).
"""

import importlib.util

PACKAGE = "decoupled-diloco"


class MissingExtra(ValueError):
    """A feature was asked for whose extra is not installed."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):      # a missing parent package, or a stubbed module
        return False


def require_extra(extra: str, purpose: str, modules: tuple[str, ...]) -> None:
    """Raise `MissingExtra` naming the extra to install unless every module is importable."""
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise MissingExtra(f"{purpose} needs the {extra!r} extra: pip install "
                           f"'{PACKAGE}[{extra}]' (missing: {', '.join(missing)})")
