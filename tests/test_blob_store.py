"""The object layer: one contract over a local directory and a loopback GCS server, plus the GCS
backend's request-level behaviour (preconditions sent, retries, permanent errors) checked by
scripting HTTP responses between the client and the server."""

import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

import pytest
import requests

from resources.store.backends import open_blob_store
from resources.store.blobs import (
    BlobNotFound,
    ListingTooLong,
    LocalBlobStore,
    PreconditionFailed,
)

BUCKET = "diloco-test"


def _unique(request) -> str:
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["local", "gcs"])
def blob_store(request, tmp_path):
    if request.param == "local":
        return open_blob_store(str(tmp_path / "store"))
    request.getfixturevalue("gcs_server")
    return open_blob_store(f"gs://{BUCKET}/{_unique(request)}")


@pytest.fixture
def gcs_store(request, gcs_server):
    store = open_blob_store(f"gs://{BUCKET}/{_unique(request)}")
    store.initial_backoff, store.max_backoff = 0.01, 0.05
    return store


# ---- the contract, on both backends ----------------------------------------------------------
def test_write_read_info_round_trip(blob_store):
    info = blob_store.write("a/b/one.bin", b"12345")
    assert (info.key, info.size) == ("a/b/one.bin", 5) and info.generation > 0
    assert blob_store.read("a/b/one.bin") == b"12345"
    assert blob_store.info("a/b/one.bin") == info
    empty = blob_store.write("empty", b"")
    assert empty.size == 0 and blob_store.read("empty") == b""
    binary = bytes(range(256)) * 64
    blob_store.write("bin", binary)
    assert blob_store.read("bin") == binary


def test_info_says_when_the_store_created_each_object(blob_store):
    # The store's own clock, so that of two identical objects the later (a copy) is known.
    import time
    first = blob_store.info(blob_store.write("a/first", b"same").key)
    time.sleep(0.05)
    second = blob_store.info(blob_store.write("b/second", b"same").key)
    assert first.created is not None and second.created is not None
    assert abs(first.created - time.time()) < 60
    assert first.created < second.created


def test_missing_key(blob_store):
    with pytest.raises(BlobNotFound):
        blob_store.read("a/none")
    assert blob_store.info("a/none") is None
    assert blob_store.list("a/") == []


def test_list_is_a_sorted_relative_prefix_listing(blob_store):
    for key in ("a/c/three.bin", "a/b/two.bin", "ab/four.bin", "a/b/one.bin", "z"):
        blob_store.write(key, key.encode())
    sibling = open_blob_store(blob_store.uri + "-sib")  # a neighbouring root sharing a prefix
    sibling.write("a/b/other.bin", b"not mine")
    assert blob_store.list("a/b/") == ["a/b/one.bin", "a/b/two.bin"]
    assert blob_store.list("a/") == ["a/b/one.bin", "a/b/two.bin", "a/c/three.bin"]
    assert blob_store.list("a") == ["a/b/one.bin", "a/b/two.bin", "a/c/three.bin", "ab/four.bin"]
    assert blob_store.list("") == ["a/b/one.bin", "a/b/two.bin", "a/c/three.bin", "ab/four.bin",
                                   "z"]
    assert blob_store.list("zzz/") == [] and blob_store.list("a/b/o") == ["a/b/one.bin"]
    assert sibling.list("") == ["a/b/other.bin"]


def test_a_listing_with_a_limit_stops_past_it(blob_store):
    """A prefix that another party fills (a learner's junk) is listed with a bound: past it the
    listing stops with `ListingTooLong` instead of walking (or paging through) everything."""
    for i in range(5):
        blob_store.write(f"p/q/{i}.bin", b"x")
    blob_store.write("p/r.bin", b"x")
    assert blob_store.list("p/q/", limit=5) == [f"p/q/{i}.bin" for i in range(5)]
    with pytest.raises(ListingTooLong, match=r"more than 4 objects under p/q/") as err:
        blob_store.list("p/q/", limit=4)
    assert (err.value.prefix, err.value.limit) == ("p/q/", 4)
    with pytest.raises(ListingTooLong):
        blob_store.list("p/", limit=5)
    assert blob_store.list("p/", limit=6) == blob_store.list("p/")


def test_a_limited_local_listing_stops_past_hidden_files_too(tmp_path):
    store = LocalBlobStore(tmp_path / "s")
    store.write("p/one.bin", b"x")
    for i in range(40):   # a writer's hidden files: never listed, still walked
        (tmp_path / "s" / "p" / f".junk-{i}").write_bytes(b"")
    assert store.list("p/") == ["p/one.bin"]
    with pytest.raises(ListingTooLong):
        store.list("p/", limit=4)


def test_delete_is_idempotent(blob_store):
    blob_store.write("k/one", b"1")
    blob_store.write("k/two", b"2")
    blob_store.delete("k/one")
    blob_store.delete("k/one")
    blob_store.delete("k/never-written")
    assert blob_store.list("k/") == ["k/two"] and blob_store.info("k/one") is None


def test_a_forgotten_key_is_gone_and_can_be_created_again(blob_store):
    blob_store.write("k/payload-abc.npz", b"bytes")
    blob_store.delete("k/payload-abc.npz", forget=True)
    blob_store.delete("k/payload-abc.npz", forget=True)     # absent: still fine
    assert blob_store.info("k/payload-abc.npz") is None and blob_store.list("k/") == []
    blob_store.write("k/payload-abc.npz", b"bytes", if_generation=0)
    assert blob_store.read("k/payload-abc.npz") == b"bytes"


def test_create_only_and_generation_checked_overwrite(blob_store):
    first = blob_store.write("ptr", b"v0", if_generation=0)
    assert blob_store.info("ptr") == first
    second = blob_store.write("ptr", b"v1", if_generation=first.generation)
    assert second.generation != first.generation and blob_store.read("ptr") == b"v1"
    assert blob_store.info("ptr").generation == second.generation
    third = blob_store.write("ptr", b"v2")  # unconditional
    assert blob_store.read("ptr") == b"v2" and blob_store.info("ptr") == third


def test_keys_cannot_escape_the_root(blob_store):
    for bad in ("../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "a/.."):
        with pytest.raises(ValueError):
            blob_store.write(bad, b"no")
        with pytest.raises(ValueError):
            blob_store.read(bad)


def test_many_writers_at_once(blob_store):
    keys = [f"w{w}/obj{i}" for w in range(8) for i in range(10)]

    def writer(w):
        return [blob_store.write(k, k.encode(), if_generation=0) for k in keys[w * 10:w * 10 + 10]]

    with ThreadPoolExecutor(8) as pool:
        infos = [info for batch in pool.map(writer, range(8)) for info in batch]
    assert [i.key for i in infos] == keys
    assert blob_store.list("w") == sorted(keys)
    assert all(blob_store.read(k) == k.encode() for k in keys)


# ---- preconditions: enforced for real on the local backend ----------------------------------
def test_precondition_failures_on_local(tmp_path):
    blobs = LocalBlobStore(tmp_path)
    first = blobs.write("p", b"1", if_generation=0)
    with pytest.raises(PreconditionFailed):
        blobs.write("p", b"2", if_generation=0)  # create-only on an existing key
    second = blobs.write("p", b"2", if_generation=first.generation)
    with pytest.raises(PreconditionFailed):
        blobs.write("p", b"3", if_generation=first.generation)  # stale generation
    with pytest.raises(PreconditionFailed):
        blobs.write("absent", b"x", if_generation=second.generation)  # expects an object
    assert blobs.read("p") == b"2" and second.generation != first.generation


def test_a_stale_generation_never_matches_a_state_with_the_same_inode_and_mtime(tmp_path):
    """A generation must name one state of a key. Here a later state gets the first state's
    inode number (ext4 hands a freed inode out again at once) and its mtime (two writes within
    the clock's granularity share a timestamp; forced with `os.utime`): a write conditional on
    the first state's generation must still be refused, and the object keep its bytes."""
    blobs = LocalBlobStore(tmp_path)
    path = tmp_path / "ptr"
    first = blobs.write("ptr", b"state-00", if_generation=0)
    before = os.stat(path)
    for i in range(1, 200):  # until the file system reuses the first state's inode
        blobs.write("ptr", b"state-%02d" % (i % 100))
        if os.stat(path).st_ino == before.st_ino:
            break
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    changed = os.stat(path)
    assert (changed.st_mtime_ns, changed.st_size) == (before.st_mtime_ns, before.st_size)
    now = blobs.info("ptr")
    with pytest.raises(PreconditionFailed, match=f"expected {first.generation}"):
        blobs.write("ptr", b"stale!!!", if_generation=first.generation)
    assert blobs.read("ptr") != b"stale!!!" and blobs.info("ptr") == now
    assert now.generation != first.generation


def test_local_generations_survive_failed_writes_and_deletes(tmp_path):
    blobs = LocalBlobStore(tmp_path)
    first = blobs.write("k", b"1", if_generation=0)
    with pytest.raises(PreconditionFailed):
        blobs.write("k", b"2", if_generation=first.generation + 1)
    assert blobs.info("k") == first  # a lost conditional write does not move the winner's
    blobs.delete("k")
    assert blobs.info("k") is None
    again = blobs.write("k", b"1", if_generation=0)  # same bytes, a new life: a new generation
    assert again.generation not in (0, first.generation)
    with pytest.raises(PreconditionFailed):
        blobs.write("k", b"3", if_generation=first.generation)
    blobs.delete("never-written/k")
    assert not (tmp_path / "never-written").exists()


def _race(tmp_path, script: str, *, racers: int, seconds: float) -> list[str]:
    """Run `script` in `racers` processes on the store at tmp_path/store, started together
    (argv: store, name, go-file, seconds); their outputs, each checked to have exited 0."""
    import subprocess
    import sys

    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "store"), f"p{k}",
                               str(go), str(seconds)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(racers)]
    time.sleep(0.5)
    go.touch()
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out)
    return outputs


CAS_RACER = """
import json, os, sys, time
from resources.store.blobs import LocalBlobStore, PreconditionFailed
blobs, me, go = LocalBlobStore(sys.argv[1]), sys.argv[2], sys.argv[3]
while not os.path.exists(go):  # start together
    time.sleep(0.001)
won, lost, deadline = [], 0, time.monotonic() + float(sys.argv[4])
while time.monotonic() < deadline:
    info = blobs.info("counter")
    seen = json.loads(blobs.read("counter"))
    mine = {"value": seen["value"] + 1, "by": me}
    try:
        blobs.write("counter", json.dumps(mine).encode(), if_generation=info.generation)
    except PreconditionFailed:
        lost += 1
        continue
    won.append([seen["value"], mine["value"]])
print(json.dumps({"won": won, "lost": lost}))
"""


def test_conditional_writes_racing_from_processes_lose_no_update(tmp_path):
    """Real processes increment one counter by compare-and-swap, as fast as they can: a write
    may succeed only if nobody wrote since its read, so every value is written exactly once
    and the final value counts every success (a write that won against a changed object would
    write a value twice and lose an increment)."""
    blobs = LocalBlobStore(tmp_path / "store")
    blobs.write("counter", json.dumps({"value": 0}).encode(), if_generation=0)
    results = [json.loads(out) for out in _race(tmp_path, CAS_RACER, racers=3, seconds=3)]
    won = sorted(pair for r in results for pair in r["won"])
    final = json.loads(blobs.read("counter"))["value"]
    assert [new for _, new in won] == list(range(1, final + 1)), "a value was written twice"
    assert all(new == old + 1 for old, new in won)
    assert all(len(r["won"]) > 0 for r in results), "every racer must get some writes in"
    assert sum(r["lost"] for r in results) > 0, "the racers never contended"


def test_a_local_delete_keeps_the_keys_lock_file_unless_it_forgets_the_key(tmp_path):
    """Retention prunes two content-named payloads a round; their lock files stayed forever (14
    of the 60 objects a round grew in the long haul)."""
    blobs = LocalBlobStore(tmp_path / "store")
    for key in ("kept", "forgotten"):
        blobs.write(f"d/{key}", b"x")
    blobs.delete("d/kept")
    blobs.delete("d/forgotten", forget=True)
    assert sorted(p.name for p in (tmp_path / "store" / "d").iterdir()) == [".kept.lock"]
    # A plain delete keeps the counter: the key created again gets a generation it never had.
    assert blobs.write("d/kept", b"y").generation == 4
    # The last key of a directory forgotten, the directories it emptied go too.
    blobs.write("r/r00000001/contributions/l0/delta.npz", b"x")
    blobs.write("r/r00000002/decision.json", b"x")
    blobs.delete("r/r00000001/contributions/l0/delta.npz", forget=True)
    assert sorted(p.name for p in (tmp_path / "store" / "r").iterdir()) == ["r00000002"]


FORGET_RACER = """
import os, sys, time
from resources.store.blobs import LocalBlobStore, PreconditionFailed
blobs, me, go = LocalBlobStore(sys.argv[1]), sys.argv[2].encode(), sys.argv[3]
while not os.path.exists(go):  # start together
    time.sleep(0.001)
owned, clashes, deadline = 0, 0, time.monotonic() + float(sys.argv[4])
while time.monotonic() < deadline:
    try:
        blobs.write("a/b/slot", me, if_generation=0)
    except PreconditionFailed:
        continue
    owned += 1
    if blobs.read("a/b/slot") != me:      # another create won over an object that existed
        clashes += 1
    blobs.delete("a/b/slot", forget=True)     # and its directories with it
print(owned, clashes)
"""


def test_forgetting_a_key_never_lets_two_processes_hold_its_lock(tmp_path):
    """Processes race to create one key only if absent, then delete it forgetting the key
    (its lock file removed, and its emptied directories): while one holds the object no other
    create may succeed. A process that opened the lock file just before it was removed must
    not lock that orphan while another locks the new file: both would see the key absent and
    both would create. A writer whose directory was just removed makes it again."""
    LocalBlobStore(tmp_path / "store")
    owned = clashes = 0
    for out in _race(tmp_path, FORGET_RACER, racers=4, seconds=4):
        o, c = map(int, out.split())
        owned, clashes = owned + o, clashes + c
    assert owned > 100, "the racers never got going"
    assert clashes == 0, f"{clashes} of {owned} creates landed on an object another held"


# ---- GCS at the HTTP level: the loopback server ignores preconditions, so check the requests --
def _response(status: int, method: str, url: str) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    response.url = url
    response.reason = HTTPStatus(status).phrase
    response.headers["Content-Type"] = "application/json"
    response._content = json.dumps(
        {"error": {"code": status, "message": HTTPStatus(status).phrase}}).encode()
    response.request = requests.Request(method, url).prepare()
    return response


_BUCKET_METADATA = re.compile(r"/storage/v1/b/[^/?]+(\?|$)")


def _intercept(monkeypatch, store, handler):
    """Route the store's object requests through `handler(n, method, url, forward)`; `n` counts
    them. Returns the list of (method, url) seen. Bucket-metadata reads, which the library also
    makes from a background thread (its bucket metadata cache), go straight through."""
    session = store.client._http
    real = session.request
    seen = []

    def request(method, url, *args, **kwargs):
        if _BUCKET_METADATA.search(url):
            return real(method, url, *args, **kwargs)
        seen.append((method, url))
        return handler(len(seen), method, url, lambda: real(method, url, *args, **kwargs))

    monkeypatch.setattr(session, "request", request)
    return seen


def _uploads(seen):
    return [url for method, url in seen if method == "POST" and "/upload/" in url]


def test_gcs_sends_the_generation_preconditions(gcs_store, monkeypatch):
    seen = _intercept(monkeypatch, gcs_store, lambda n, m, u, forward: forward())
    first = gcs_store.write("ptr", b"v0", if_generation=0)
    gcs_store.write("ptr", b"v1", if_generation=first.generation)
    gcs_store.write("ptr", b"v2")
    create, replace, plain = _uploads(seen)
    assert "ifGenerationMatch=0" in create
    assert f"ifGenerationMatch={first.generation}" in replace
    assert "ifGenerationMatch" not in plain
    assert all(f"/upload/storage/v1/b/{BUCKET}/o?" in url for url in (create, replace, plain))


def test_gcs_412_is_precondition_failed_and_not_retried(gcs_store, monkeypatch):
    gcs_store.write("ptr", b"theirs")
    seen = _intercept(monkeypatch, gcs_store, lambda n, method, url, forward:
                      _response(412, method, url) if "/upload/" in url else forward())
    with pytest.raises(PreconditionFailed, match=rf"gs://{BUCKET}/.*/ptr"):
        gcs_store.write("ptr", b"mine", if_generation=0)
    assert len(_uploads(seen)) == 1
    assert gcs_store.read("ptr") == b"theirs"


def test_gcs_maps_the_librarys_precondition_error(gcs_store, monkeypatch):
    from google.api_core import exceptions as gexc
    from google.cloud.storage import Blob

    def stub(self, data, **kwargs):
        assert kwargs["if_generation_match"] == 7
        raise gexc.PreconditionFailed("conditionNotMet")

    monkeypatch.setattr(Blob, "upload_from_string", stub)
    with pytest.raises(PreconditionFailed):
        gcs_store.write("ptr", b"x", if_generation=7)


def test_gcs_retries_transient_errors(gcs_store, monkeypatch):
    def flaky(n, method, url, forward):
        if n == 1:
            return _response(503, method, url)  # the upload's first attempt
        if n == 3:
            raise requests.ConnectionError("connection reset by peer")  # the download's
        if n == 5:
            return _response(429, method, url)  # the metadata read's
        return forward()

    seen = _intercept(monkeypatch, gcs_store, flaky)
    info = gcs_store.write("k", b"payload", if_generation=0)
    assert len(_uploads(seen)) == 2
    assert gcs_store.read("k") == b"payload"
    assert gcs_store.info("k") == info
    assert len(seen) == 6


def test_gcs_conditional_write_whose_response_was_lost(gcs_store, monkeypatch):
    """The first attempt lands but its response is a 503; the retry meets its own write (412).
    The store sees that the object holds its bytes and reports success."""
    def lost_response(n, method, url, forward):
        if "/upload/" not in url:
            return forward()
        if n == 1:
            forward()
            return _response(503, method, url)
        return _response(412, method, url)

    _intercept(monkeypatch, gcs_store, lost_response)
    info = gcs_store.write("ptr", b"mine", if_generation=0)
    monkeypatch.undo()
    assert gcs_store.read("ptr") == b"mine" and gcs_store.info("ptr") == info


def test_gcs_retried_conditional_write_that_really_lost(gcs_store, monkeypatch):
    gcs_store.write("ptr", b"theirs")

    def lost_race(n, method, url, forward):
        if "/upload/" not in url:
            return forward()
        return _response(503 if n == 1 else 412, method, url)

    _intercept(monkeypatch, gcs_store, lost_race)
    with pytest.raises(PreconditionFailed):
        gcs_store.write("ptr", b"mine", if_generation=0)


def test_gcs_permanent_errors_fail_fast_naming_bucket_and_key(gcs_store, monkeypatch):
    from resources.store.gcs_blobs import GCSStoreError

    seen = _intercept(monkeypatch, gcs_store, lambda n, method, url, forward:
                      _response(403, method, url))
    where = rf"gs://{BUCKET}/{gcs_store.prefix}/dir/k"
    with pytest.raises(GCSStoreError, match=rf"write {where} failed: 403 .*permissions"):
        gcs_store.write("dir/k", b"x", if_generation=0)
    with pytest.raises(GCSStoreError, match=rf"read {where} failed: 403"):
        gcs_store.read("dir/k")
    with pytest.raises(GCSStoreError, match=rf"info {where} failed: 403"):
        gcs_store.info("dir/k")
    assert len(seen) == 3  # one attempt each
    monkeypatch.undo()

    _intercept(monkeypatch, gcs_store, lambda n, method, url, forward: _response(400, method, url))
    with pytest.raises(GCSStoreError, match=rf"list gs://{BUCKET}/{gcs_store.prefix}/dir/\*"):
        gcs_store.list("dir/")


def test_gcs_gives_up_after_the_retry_deadline(gcs_store, monkeypatch):
    from resources.store.gcs_blobs import GCSStoreError

    gcs_store.retry_deadline = 0.3
    seen = _intercept(monkeypatch, gcs_store, lambda n, method, url, forward:
                      _response(503, method, url))
    with pytest.raises(GCSStoreError, match=r"still failing after retrying for 0.3s"):
        gcs_store.write("k", b"x")
    assert len(seen) > 1


def test_gcs_missing_bucket_is_not_an_absent_key(gcs_server):
    from resources.store.gcs_blobs import GCSStoreError

    store = open_blob_store("gs://no-such-bucket/p")
    for call in (lambda: store.read("k"), lambda: store.info("k"), lambda: store.list("")):
        with pytest.raises(GCSStoreError, match="no-such-bucket"):
            call()


def test_gcs_prefix_and_key_join_with_one_slash(gcs_server):
    from resources.store.gcs_blobs import GCSBlobStore

    prefix = f"join-{uuid.uuid4().hex[:8]}"
    store = GCSBlobStore(BUCKET, f"/{prefix}/sub/")
    assert store.uri == f"gs://{BUCKET}/{prefix}/sub"
    store.write("k/v", b"x")
    assert store.client.bucket(BUCKET).get_blob(f"{prefix}/sub/k/v").size == 1
    assert GCSBlobStore(BUCKET).uri == f"gs://{BUCKET}"
    for bad in ("bad/bucket", "", "UPPER"):
        with pytest.raises(ValueError):
            GCSBlobStore(bad)
    with pytest.raises(ValueError):
        GCSBlobStore(BUCKET, "a/../b")


# ---- open_blob_store ---------------------------------------------------------------------------
def test_open_blob_store_dispatch(tmp_path, gcs_server):
    from resources.store.gcs_blobs import GCSBlobStore

    assert isinstance(open_blob_store(str(tmp_path / "a")), LocalBlobStore)
    local = open_blob_store(f"file://{tmp_path}/b")
    assert isinstance(local, LocalBlobStore) and local.uri == str(tmp_path / "b")
    gcs = open_blob_store(f"gs://{BUCKET}/runs/exp1/")
    assert isinstance(gcs, GCSBlobStore)
    assert (gcs.bucket_name, gcs.prefix, gcs.uri) == (BUCKET, "runs/exp1",
                                                      f"gs://{BUCKET}/runs/exp1")
    for bad in ("s3://bucket/x", "http://example.com/x", "gs:///x", "", "file://host/x"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            open_blob_store(bad)
