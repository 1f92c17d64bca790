"""`BlobStore` over a Google Cloud Storage prefix (`gs://bucket/prefix`), with retries and timeouts.

Every request carries a per-request `timeout` and a `google.api_core.retry.Retry` built here:
exponential backoff with jitter (0.5 s doubling to 16 s) until `retry_deadline`, retrying only
transient failures (`is_transient`: 408, 429, 5xx, connection resets, timeouts). Permanent
failures (400, 403, a missing bucket, ...) are not retried and surface at once as
`GCSStoreError`, whose message names the operation, `gs://bucket/object` and the status.

Retry policy for writes, and why it is safe:
- Conditional writes (`if_generation` set -> `ifGenerationMatch`) are retried. A precondition
  makes the request safe to repeat: it can never replace an object it did not mean to, which is
  exactly why google-cloud-storage's own `DEFAULT_RETRY_IF_GENERATION_SPECIFIED` (a
  `ConditionalRetryPolicy`) retries uploads only when a generation is given. The one hazard is a
  false negative: the first attempt lands but its response is lost, so the retry meets its own
  write and gets 412. `write` resolves that case itself: when a 412 follows a retried attempt,
  it compares the object now stored with the bytes it sent (size and CRC32C) and reports success
  if they match. A 412 on a first attempt is always a real lost race -> `PreconditionFailed`.
- Unconditional writes are retried too (the library's default for `upload_from_string`): a
  repeat stores the same bytes again, and unconditional writes promise last-writer-wins only.

Uploads of up to 8 MiB go out as one multipart request, larger ones as a resumable upload; either
way the object appears whole or not at all. Downloads are checked against the stored CRC32C.

Credentials: Application Default Credentials, or anonymous ones when `STORAGE_EMULATOR_HOST`
points at a test server. They are never logged, and error messages carry only URLs and statuses.
"""

import base64
import http.client
import os
import re
import threading

import google_crc32c
import requests
import urllib3
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from resources.store.blobs import (
    BlobInfo,
    BlobNotFound,
    BlobStore,
    ListingTooLong,
    PreconditionFailed,
)

_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_MAX_OBJECT_NAME_BYTES = 1024

TRANSIENT_STATUS_CODES = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_TYPES = (
    gexc.TooManyRequests, gexc.InternalServerError, gexc.BadGateway, gexc.ServiceUnavailable,
    gexc.GatewayTimeout, ConnectionError, TimeoutError, requests.ConnectionError,
    requests.Timeout, requests.exceptions.ChunkedEncodingError, http.client.BadStatusLine,
    http.client.IncompleteRead, http.client.ResponseNotReady, urllib3.exceptions.PoolError,
    urllib3.exceptions.ProtocolError, urllib3.exceptions.SSLError,
    urllib3.exceptions.TimeoutError,
)


class GCSStoreError(RuntimeError):
    """A GCS request that failed for good: refused (400, 403, missing bucket), or still failing
    transiently when the retry deadline ran out. The message names the bucket and object."""


def is_transient(exc: BaseException) -> bool:
    """The retry predicate: rate limiting, server errors, dropped connections and timeouts."""
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    if isinstance(exc, gexc.GoogleAPICallError):
        return exc.code in TRANSIENT_STATUS_CODES
    if isinstance(exc, InvalidResponse):  # raw media-layer error, before mapping to api_core
        return getattr(exc.response, "status_code", None) in TRANSIENT_STATUS_CODES
    if isinstance(exc, auth_exceptions.TransportError):  # e.g. a token refresh that timed out
        return bool(exc.args) and isinstance(exc.args[0], BaseException) \
            and is_transient(exc.args[0])
    return False


# Requests in flight at once from one store (`GCSBlobStore.read_concurrency`), and the HTTP
# connections kept for them: requests keeps 10 per host by default and closes any beyond that
# after each request, so every tick's extra reads would open new connections.
READ_CONCURRENCY = 16
HTTP_POOL_CONNECTIONS = 2 * READ_CONCURRENCY


def default_client() -> storage.Client:
    """ADC; anonymous credentials against an emulator (`STORAGE_EMULATOR_HOST`)."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "test"),
                                credentials=AnonymousCredentials())
    else:
        client = storage.Client()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=HTTP_POOL_CONNECTIONS)
    for scheme in ("https://", "http://"):
        client._http.mount(scheme, adapter)     # the client's own session (created here)
    return client


def _check_key(key: str, *, allow_trailing_slash: bool = False) -> str:
    """Keys are '/'-separated; no leading '/', no empty, '.' or '..' segments."""
    if not isinstance(key, str) or key.startswith("/"):
        raise ValueError(f"unsafe key {key!r}")
    parts = key.split("/")
    if allow_trailing_slash and len(parts) > 1 and parts[-1] == "":
        parts = parts[:-1]
    if any(part in ("", ".", "..") for part in parts) or any(c in key for c in "\r\n\x00"):
        raise ValueError(f"unsafe key {key!r}")
    return key


def _crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode("ascii")


class GCSBlobStore(BlobStore):
    """Objects under `gs://bucket/prefix`; keys are joined under the prefix with one '/'."""

    read_concurrency = READ_CONCURRENCY
    # Backoff of the retry policy (seconds); instances may lower them (tests do).
    initial_backoff = 0.5
    max_backoff = 16.0
    backoff_multiplier = 2.0

    def __init__(self, bucket: str, prefix: str = "", client: storage.Client | None = None,
                 timeout: float = 60.0, retry_deadline: float = 120.0):
        if not isinstance(bucket, str) or _BUCKET.fullmatch(bucket) is None:
            raise ValueError(f"invalid GCS bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            _check_key(prefix)
        self.bucket_name = bucket
        self.prefix = prefix
        self.client = client if client is not None else default_client()
        self.bucket = self.client.bucket(bucket)
        self.timeout = timeout
        self.retry_deadline = retry_deadline
        self._bucket_seen = False
        self._bucket_lock = threading.Lock()

    @property
    def uri(self) -> str:
        return f"gs://{self.bucket_name}/{self.prefix}" if self.prefix else f"gs://{self.bucket_name}"

    def _retry(self, on_error=None) -> Retry:
        return Retry(predicate=is_transient, initial=self.initial_backoff,
                     maximum=self.max_backoff, multiplier=self.backoff_multiplier,
                     timeout=self.retry_deadline, on_error=on_error)

    def _name(self, key: str) -> str:
        name = f"{self.prefix}/{_check_key(key)}" if self.prefix else _check_key(key)
        if len(name.encode()) > _MAX_OBJECT_NAME_BYTES:
            raise ValueError(f"key {key!r} makes an object name over "
                             f"{_MAX_OBJECT_NAME_BYTES} bytes")
        return name

    def _error(self, op: str, name: str, err: BaseException) -> GCSStoreError:
        where = f"gs://{self.bucket_name}/{name}"
        if isinstance(err, gexc.RetryError):
            return GCSStoreError(f"GCS {op} {where}: still failing after retrying for "
                                 f"{self.retry_deadline:g}s: {err.cause or err}")
        if isinstance(err, gexc.GoogleAPICallError):
            hint = " (check the credentials' permissions on the bucket)" \
                if err.code in (401, 403) else ""
            return GCSStoreError(f"GCS {op} {where} failed: {err.code} {err.message}{hint}")
        return GCSStoreError(f"GCS {op} {where} failed: {type(err).__name__}: {err}")

    def _check_bucket(self, op: str, name: str) -> None:
        """After a 404 on an object: a missing bucket is a permanent error, not an absent key.
        Checked once per store (a bucket we saw does not count as missing later)."""
        if self._bucket_seen:
            return
        with self._bucket_lock:
            if self._bucket_seen:
                return
            try:
                exists = self.bucket.exists(timeout=self.timeout, retry=self._retry())
            except (gexc.GoogleAPIError, auth_exceptions.GoogleAuthError):
                exists = True  # e.g. no storage.buckets.get permission: cannot tell, assume so
            if not exists:
                raise GCSStoreError(f"GCS {op} gs://{self.bucket_name}/{name} failed: bucket "
                                    f"{self.bucket_name!r} does not exist")
            self._bucket_seen = True

    # ---- BlobStore ----------------------------------------------------------------------------
    def write(self, key: str, data: bytes, *, if_generation: int | None = None) -> BlobInfo:
        name = self._name(key)
        data = bytes(data)
        blob = self.bucket.blob(name)
        retried: list[BaseException] = []
        try:
            blob.upload_from_string(data, content_type="application/octet-stream",
                                    if_generation_match=if_generation, timeout=self.timeout,
                                    retry=self._retry(on_error=retried.append))
        except gexc.PreconditionFailed:
            if retried:
                landed = self._our_write_landed(name, key, data)
                if landed is not None:
                    return landed
            raise PreconditionFailed(
                f"gs://{self.bucket_name}/{name}: precondition failed (wanted generation "
                f"{if_generation}; 0 means absent)") from None
        except (gexc.GoogleAPIError, auth_exceptions.GoogleAuthError, DataCorruption) as err:
            raise self._error("write", name, err) from err
        size = int(blob.size) if blob.size is not None else len(data)
        return BlobInfo(key, size, int(blob.generation))

    def _our_write_landed(self, name: str, key: str, data: bytes) -> BlobInfo | None:
        """A 412 after a retried conditional write: did the lost first attempt store our bytes?"""
        try:
            blob = self.bucket.get_blob(name, timeout=self.timeout, retry=self._retry())
        except (gexc.GoogleAPIError, auth_exceptions.GoogleAuthError) as err:
            raise self._error("write", name, err) from err
        if blob is not None and blob.size == len(data) and blob.crc32c == _crc32c_b64(data):
            return BlobInfo(key, int(blob.size), int(blob.generation))
        return None

    def read(self, key: str) -> bytes:
        name = self._name(key)
        try:
            return self.bucket.blob(name).download_as_bytes(timeout=self.timeout,
                                                            retry=self._retry())
        except gexc.NotFound:
            self._check_bucket("read", name)
            raise BlobNotFound(key) from None
        except (gexc.GoogleAPIError, auth_exceptions.GoogleAuthError, DataCorruption) as err:
            raise self._error("read", name, err) from err

    def info(self, key: str) -> BlobInfo | None:
        name = self._name(key)
        try:
            blob = self.bucket.get_blob(name, timeout=self.timeout, retry=self._retry())
        except (gexc.GoogleAPIError, auth_exceptions.GoogleAuthError) as err:
            raise self._error("info", name, err) from err
        if blob is None:
            self._check_bucket("info", name)
            return None
        created = blob.time_created.timestamp() if blob.time_created is not None else None
        return BlobInfo(key, int(blob.size), int(blob.generation), created)

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        if prefix:
            _check_key(prefix, allow_trailing_slash=True)
        root = f"{self.prefix}/" if self.prefix else ""
        full = root + prefix
        try:
            # With a limit, the client stops after limit + 1 objects (the pages that hold them).
            blobs = self.client.list_blobs(self.bucket_name, prefix=full, timeout=self.timeout,
                                           retry=self._retry(),
                                           max_results=None if limit is None else limit + 1)
            names = [blob.name for blob in blobs]
        except (gexc.GoogleAPIError, auth_exceptions.GoogleAuthError) as err:
            raise self._error("list", full + "*", err) from err
        if limit is not None and len(names) > limit:
            raise ListingTooLong(prefix, limit)
        # Folder placeholders ("dir/") are not objects of this store.
        return sorted(n[len(root):] for n in names if n.startswith(full) and not n.endswith("/"))

    def delete(self, key: str, *, forget: bool = False) -> None:
        # `forget` asks nothing more here: GCS keeps no per-key state beside the object.
        name = self._name(key)
        try:
            self.bucket.blob(name).delete(timeout=self.timeout, retry=self._retry())
        except gexc.NotFound:
            self._check_bucket("delete", name)
        except (gexc.GoogleAPIError, auth_exceptions.GoogleAuthError) as err:
            raise self._error("delete", name, err) from err
