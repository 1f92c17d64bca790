"""A real GCS JSON-API server on loopback (gcp-storage-emulator), started and stopped by tests."""

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

BUCKET = "diloco-test"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def gcs_emulator() -> Iterator[str]:
    """Start the server, point google-cloud-storage and TensorStore at it, yield its URL."""
    from gcp_storage_emulator.server import create_server

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
           "GOOGLE_CLOUD_PROJECT": "test", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield url
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
