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
