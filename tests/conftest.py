"""Test-wide settings: CPU only, strict shapes, and a small shared corpus."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


import pytest  # noqa: E402


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
