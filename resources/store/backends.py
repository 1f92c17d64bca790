"""Open a blob store from a URI: a local path (or file:// URI) or gs://bucket/prefix."""

import re
from urllib.parse import unquote, urlparse

from resources.store.blobs import BlobStore, LocalBlobStore

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def open_blob_store(uri: str) -> BlobStore:
    """`gs://bucket[/prefix]` -> `GCSBlobStore`; a path or `file:///path` -> `LocalBlobStore`.
    Any other scheme (s3://, http://, ...) is a `ValueError` naming the URI."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"empty store URI {uri!r}: use a local path or gs://bucket/prefix")
    match = _SCHEME.match(uri)
    if match is None:
        return LocalBlobStore(uri)
    scheme = match.group(1).lower()
    rest = uri[match.end():]
    if scheme == "gs":
        from resources.extras import require_extra

        require_extra("gcp", f"the store {uri}", ("google.cloud.storage", "google_crc32c",
                                                  "gcsfs"))
        from resources.store.gcs_blobs import GCSBlobStore

        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"store URI {uri!r} names no bucket: use gs://bucket/prefix")
        return GCSBlobStore(bucket, prefix)
    if scheme == "file":
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ValueError(f"unsupported file URI {uri!r}: use file:///absolute/path")
        return LocalBlobStore(unquote(parsed.path))
    raise ValueError(f"unsupported store URI {uri!r}: use a local path or gs://bucket/prefix")
