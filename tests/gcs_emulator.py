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


def _send_generation_headers() -> None:
    """Make media downloads carry `x-goog-generation` / `x-goog-metageneration`, as real GCS
    does. TensorStore reads the generation of every object it downloads to make its
    conditional writes (Orbax's OCDBT checkpoints); without the header it fails with
    "Malformed StorageGeneration"."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    original = objects.download
    if getattr(original, "sends_generation", False):
        return

    def download(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"],
                                       request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
        except NotFound:
            pass  # the original handler answers 404
        return original(request, response, storage, *args, **kwargs)

    download.sends_generation = True
    objects.download = download
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is original:
                methods[method] = download


def _enforce_generation_preconditions() -> None:
    """Make uploads and deletes honour `ifGenerationMatch` / `ifGenerationNotMatch` (412 when
    not met), as real GCS does; the emulator ignores them, so no test could reach a lost race
    on GCS. Check and write happen under one lock, like GCS's atomic conditional write."""
    import threading
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    if getattr(objects.insert, "enforces_preconditions", False):
        return
    lock = threading.Lock()

    def met(request, storage, object_id) -> bool:
        match = request.query.get("ifGenerationMatch")
        not_match = request.query.get("ifGenerationNotMatch")
        if not match and not not_match:
            return True
        try:
            current = int(storage.get_file_obj(request.params["bucket_name"], object_id)
                          ["generation"])
        except NotFound:
            current = 0   # GCS: generation 0 means "no live object"
        return not ((match and int(match[0]) != current)
                    or (not_match and int(not_match[0]) == current))

    def conditional(original, object_id_of):
        def handler(request, response, storage, *args, **kwargs):
            with lock:
                object_id = object_id_of(request)
                if object_id is not None and not met(request, storage, object_id):
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                    return None
                return original(request, response, storage, *args, **kwargs)
        handler.enforces_preconditions = True
        return handler

    def uploaded_name(request):
        if "name" in request.query:
            return request.query["name"][0]
        data = request.data
        return data["meta"].get("name") if isinstance(data, dict) and "meta" in data else None

    replaced = {objects.insert: conditional(objects.insert, uploaded_name),
                objects.delete: conditional(objects.delete,
                                            lambda request: request.params["object_id"])}
    for original, handler in replaced.items():
        setattr(objects, original.__name__, handler)
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler in replaced:
                methods[method] = replaced[handler]


@contextmanager
def gcs_emulator() -> Iterator[str]:
    """Start the server, point google-cloud-storage and TensorStore at it, yield its URL."""
    from gcp_storage_emulator.server import create_server

    _send_generation_headers()
    _enforce_generation_preconditions()
    # The server answers one connection at a time from a listen queue of 5 (socketserver's
    # default); the store reads up to `read_concurrency` objects at once, and a connection
    # beyond the queue waits a second for its SYN to be sent again. Real GCS queues nothing.
    from http import server as http_server
    http_server.HTTPServer.request_queue_size = 128
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
