"""Test-wide settings: CPU only, strict shapes, and a small shared corpus."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


import pytest  # noqa: E402

# Ends what a session leaves running (tests/session_cleanup.py).
pytest_plugins = ["session_cleanup"]


@pytest.fixture(scope="session")
def gcs_server():
    """One loopback GCS server per test session; yields its URL."""
    from gcs_emulator import gcs_emulator

    with gcs_emulator() as url:
        yield url


@pytest.fixture(scope="session")
def postgres_cluster():
    """One throwaway PostgreSQL server per test session (tests/postgres_server.py); yields the
    URL of its first database. Without the server binaries it skips, except under CI (env
    `CI` set), where it fails: CI installs them, so a skip there would hide a broken setup."""
    from postgres_server import PostgresUnavailable, check_available, postgres_server

    try:
        check_available()
    except PostgresUnavailable as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs a PostgreSQL server: {err}")
        pytest.skip(str(err))
    with postgres_server() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_cluster):
    """The URL of a fresh, empty database on the session's PostgreSQL server."""
    from postgres_server import create_database, fresh_database_name

    return create_database(postgres_cluster, fresh_database_name())


@pytest.fixture(scope="module", autouse=True)
def _no_dagster_instance_left_open():
    """A Dagster instance entered and never exited (e.g. a schedule or sensor context built
    without `with`) stays the process's current defs-state storage; once the instance is
    collected, every later definitions load in the session fails with "Attempted to resolve
    undefined DagsterInstance weakref" (a fresh-clone CI run failed on it, two modules
    later). Fail the module that leaves one, and clear it so the rest of the run is not hit."""
    yield
    from dagster._core.storage.defs_state.base import DefsStateStorage, set_defs_state_storage

    leaked = DefsStateStorage.get()
    if leaked is not None:
        set_defs_state_storage(None).__enter__()    # never exited: reset for the session
        pytest.fail(f"a Dagster instance was left open in this module ({leaked!r})")

