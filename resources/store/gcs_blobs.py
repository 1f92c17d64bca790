"""`BlobStore` over a Google Cloud Storage prefix, with retries and timeouts.

Retry policy: every request uses google-cloud-storage's `DEFAULT_RETRY` (exponential backoff on
429, 5xx, connection resets and timeouts) with a deadline of `retry_deadline` seconds, including
writes. That is safe here because every write the artifact store makes is either conditional
(create-only payloads and manifests, generation-checked pointers) or idempotent (the summary):
a retried create whose first attempt landed comes back as a precondition failure, which the
artifact store resolves by comparing content. Permanent errors (400, 403, 404 on the bucket)
are not retried and surface as `GCSStoreError` naming the bucket and key.

Credentials: Application Default Credentials, or anonymous ones when `STORAGE_EMULATOR_HOST`
points at a loopback test server. They are never logged.
"""

import os

from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from resources.store.blobs import BlobInfo, BlobNotFound, BlobStore, PreconditionFailed


class GCSStoreError(RuntimeError):
    """A request GCS refused for good (permissions, missing bucket, bad request)."""


def default_client() -> storage.Client:
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "test"),
                              credentials=AnonymousCredentials())
    return storage.Client()


class GCSBlobStore(BlobStore):
    def __init__(self, bucket: str, prefix: str = "", client: storage.Client | None = None,
                 timeout: float = 60.0, retry_deadline: float = 120.0):
        if not bucket or "/" in bucket:
            raise ValueError(f"bad bucket name {bucket!r}")
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.client = client or default_client()
        self.bucket = self.client.bucket(bucket)
        self.timeout = timeout
        self.retry = DEFAULT_RETRY.with_deadline(retry_deadline)

    @property
    def uri(self) -> str:
        return f"gs://{self.bucket_name}/{self.prefix}" if self.prefix else f"gs://{self.bucket_name}"

    def _name(self, key: str) -> str:
        if key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"unsafe key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, err: Exception, key: str) -> GCSStoreError:
        return GCSStoreError(f"gs://{self.bucket_name}/{self._name(key)}: {err}")

    def write(self, key: str, data: bytes, *, if_generation: int | None = None) -> BlobInfo:
        blob = self.bucket.blob(self._name(key))
        try:
            blob.upload_from_string(data, content_type="application/octet-stream",
                                    if_generation_match=if_generation, timeout=self.timeout,
                                    retry=self.retry)
        except gexc.PreconditionFailed:
            raise PreconditionFailed(f"{key}: generation is not {if_generation}") from None
        except gexc.GoogleAPICallError as err:
            raise self._fail(err, key) from err
        return BlobInfo(key, len(data), int(blob.generation or 0))

    def read(self, key: str) -> bytes:
        try:
            return self.bucket.blob(self._name(key)).download_as_bytes(timeout=self.timeout,
                                                                       retry=self.retry)
        except gexc.NotFound:
            raise BlobNotFound(key) from None
        except gexc.GoogleAPICallError as err:
            raise self._fail(err, key) from err

    def info(self, key: str) -> BlobInfo | None:
        try:
            blob = self.bucket.get_blob(self._name(key), timeout=self.timeout, retry=self.retry)
        except gexc.GoogleAPICallError as err:
            raise self._fail(err, key) from err
        return None if blob is None else BlobInfo(key, int(blob.size), int(blob.generation))

    def list(self, prefix: str) -> list[str]:
        full = self._name(prefix.rstrip("/")) + ("/" if prefix.endswith("/") else "") \
            if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        try:
            blobs = self.client.list_blobs(self.bucket_name, prefix=full, timeout=self.timeout,
                                           retry=self.retry)
            return sorted(b.name[strip:] for b in blobs)
        except gexc.GoogleAPICallError as err:
            raise self._fail(err, prefix) from err

    def delete(self, key: str) -> None:
        try:
            self.bucket.blob(self._name(key)).delete(timeout=self.timeout, retry=self.retry)
        except gexc.NotFound:
            pass
        except gexc.GoogleAPICallError as err:
            raise self._fail(err, key) from err
