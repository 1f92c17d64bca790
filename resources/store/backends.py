"""Open a blob store from a URI: a local path (or file://) or gs://bucket/prefix."""

from resources.store.blobs import BlobStore, LocalBlobStore


def open_blob_store(uri: str) -> BlobStore:
    if uri.startswith("gs://"):
        from resources.store.gcs_blobs import GCSBlobStore

        bucket, _, prefix = uri[len("gs://"):].partition("/")
        return GCSBlobStore(bucket, prefix)
    if uri.startswith("file://"):
        return LocalBlobStore(uri[len("file://"):])
    if "://" in uri:
        raise ValueError(f"unsupported store URI {uri!r}: use a local path or gs://bucket/prefix")
    return LocalBlobStore(uri)
