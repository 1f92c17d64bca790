"""The object layer under the artifact store: write-once objects and generation-checked pointers.

Two backends implement `BlobStore`: a local directory (`LocalBlobStore`) and a GCS bucket prefix
(`GCSBlobStore`). Both give the same guarantees, which the artifact store builds on:
- `write(key, data)` makes the object appear whole or not at all (local: write to a temporary
  file, fsync, atomic rename; GCS: single-request uploads are atomic);
- `write(..., if_generation=0)` creates only if absent, `if_generation=g` replaces only if the
  current generation is g (local: under an exclusive lock; GCS: `ifGenerationMatch`), raising
  `PreconditionFailed` otherwise: the compare-and-swap that pointer moves need;
- `list(prefix)` lists keys under a prefix only (never a bucket scan).
"""

import abc
import contextlib
import fcntl
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


class BlobNotFound(KeyError):
    """No object under this key."""


class PreconditionFailed(RuntimeError):
    """A conditional write lost: the object exists, or its generation moved on."""


@dataclass(frozen=True)
class BlobInfo:
    key: str
    size: int
    generation: int


class BlobStore(abc.ABC):
    """Keys are '/'-separated paths relative to the store's root."""

    @abc.abstractmethod
    def write(self, key: str, data: bytes, *, if_generation: int | None = None) -> BlobInfo:
        """Store `data` under `key`. `if_generation=0`: only if absent; `g`: only if at g."""

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """The object's bytes; `BlobNotFound` if absent."""

    @abc.abstractmethod
    def info(self, key: str) -> BlobInfo | None:
        """Size and generation, or None if absent."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; absent is fine."""

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """Where the root is, e.g. a path or gs://bucket/prefix (for Orbax and for people)."""


class LocalBlobStore(BlobStore):
    """A directory. Generations are the file's modification counter kept in a sidecar-free way:
    the nanosecond mtime plus inode, which change on every atomic replace."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def uri(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"unsafe key {key!r}")
        path = (self.root / key).resolve()
        if path != self.root and self.root not in path.parents:
            raise ValueError(f"key {key!r} escapes the store root")
        return path

    @staticmethod
    def _generation(stat: os.stat_result) -> int:
        # Changes whenever the file is replaced (new inode) or rewritten (new mtime).
        return (stat.st_ino << 20) ^ stat.st_mtime_ns or 1

    @contextlib.contextmanager
    def _locked(self, path: Path):
        lock = path.parent / f".{path.name}.lock"
        with open(lock, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def write(self, key: str, data: bytes, *, if_generation: int | None = None) -> BlobInfo:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked(path) if if_generation is not None else contextlib.nullcontext():
            if if_generation is not None:
                current = self.info(key)
                if (current.generation if current else 0) != if_generation:
                    raise PreconditionFailed(
                        f"{key}: generation is {current.generation if current else 0}, "
                        f"expected {if_generation}")
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            stat = path.stat()
        return BlobInfo(key, stat.st_size, self._generation(stat))

    def read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise BlobNotFound(key) from None

    def info(self, key: str) -> BlobInfo | None:
        try:
            stat = self._path(key).stat()
        except FileNotFoundError:
            return None
        return BlobInfo(key, stat.st_size, self._generation(stat))

    def list(self, prefix: str) -> list[str]:
        # Walk only the deepest directory the prefix names: a prefix listing, not a tree scan.
        base = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for path in base.rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()
