"""The object layer: one contract over a local directory and the loopback GCS server."""

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from resources.store.backends import open_blob_store
from resources.store.blobs import BlobNotFound, LocalBlobStore, PreconditionFailed


@pytest.fixture(params=["local", "gcs"])
def blobs(request, tmp_path):
    if request.param == "local":
        return open_blob_store(str(tmp_path))
    request.getfixturevalue("gcs_server")
    return open_blob_store(f"gs://diloco-test/b-{uuid.uuid4().hex[:12]}")


def test_round_trip_info_list_delete(blobs):
    info = blobs.write("a/b/one.bin", b"12345")
    assert info.size == 5 and info.generation > 0
    assert blobs.read("a/b/one.bin") == b"12345"
    assert blobs.info("a/b/one.bin").size == 5 and blobs.info("a/b/none") is None
    blobs.write("a/b/two.bin", b"x")
    blobs.write("a/c/three.bin", b"y")
    blobs.write("ab/four.bin", b"z")
    assert blobs.list("a/b/") == ["a/b/one.bin", "a/b/two.bin"]
    assert blobs.list("a/") == ["a/b/one.bin", "a/b/two.bin", "a/c/three.bin"]
    assert blobs.list("zzz/") == []
    with pytest.raises(BlobNotFound):
        blobs.read("a/b/none")
    blobs.delete("a/b/one.bin")
    blobs.delete("a/b/one.bin")  # idempotent
    assert blobs.list("a/b/") == ["a/b/two.bin"]


def test_create_only_and_generation_checked_writes_on_local(tmp_path):
    blobs = LocalBlobStore(tmp_path)
    first = blobs.write("p", b"1", if_generation=0)
    with pytest.raises(PreconditionFailed):
        blobs.write("p", b"2", if_generation=0)
    second = blobs.write("p", b"2", if_generation=first.generation)
    with pytest.raises(PreconditionFailed):
        blobs.write("p", b"3", if_generation=first.generation)  # stale generation
    assert blobs.read("p") == b"2" and second.generation != first.generation


def test_keys_cannot_escape_the_root(blobs):
    for bad in ("../x", "a/../../x", "/etc/passwd", "a//b"):
        with pytest.raises(ValueError):
            blobs.write(bad, b"no")


def test_many_writers_at_once(blobs):
    keys = [f"w{w}/obj{i}" for w in range(8) for i in range(10)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: blobs.write(k, k.encode(), if_generation=0), keys))
    assert blobs.list("w") == sorted(keys)
    assert all(blobs.read(k) == k.encode() for k in keys[::7])


def test_open_blob_store_dispatch(tmp_path):
    assert isinstance(open_blob_store(str(tmp_path)), LocalBlobStore)
    assert isinstance(open_blob_store(f"file://{tmp_path}"), LocalBlobStore)
    with pytest.raises(ValueError, match="unsupported store URI"):
        open_blob_store("s3://bucket/x")


def test_gcs_retries_transient_errors_and_fails_fast_on_permanent_ones(gcs_server, monkeypatch):
    from google.api_core import exceptions as gexc
    from google.cloud.storage import Blob

    from resources.store.gcs_blobs import GCSStoreError

    blobs = open_blob_store(f"gs://diloco-test/r-{uuid.uuid4().hex[:12]}")
    blobs.retry = blobs.retry.with_delay(initial=0.01, maximum=0.02)
    calls = []
    original = Blob.download_as_bytes

    def flaky(self, **kwargs):
        # Stand-in for the transport: the first attempt gets a 503, the retry goes through.
        def attempt():
            calls.append(1)
            if len(calls) == 1:
                raise gexc.ServiceUnavailable("try again")
            return original(self, **{**kwargs, "retry": None})
        return kwargs["retry"](attempt)()

    blobs.write("k", b"payload")
    monkeypatch.setattr(Blob, "download_as_bytes", flaky)
    assert blobs.read("k") == b"payload" and len(calls) == 2

    calls.clear()

    def forbidden(self, **kwargs):
        def attempt():
            calls.append(1)
            raise gexc.Forbidden("no access")
        return kwargs["retry"](attempt)()

    monkeypatch.setattr(Blob, "download_as_bytes", forbidden)
    with pytest.raises(GCSStoreError, match=r"gs://diloco-test/r-.*/k: 403"):
        blobs.read("k")
    assert len(calls) == 1
