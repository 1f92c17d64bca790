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
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


class BlobNotFound(KeyError):
    """No object under this key."""


class PreconditionFailed(RuntimeError):
    """A conditional write lost: the object exists, or its generation moved on."""


class ListingTooLong(RuntimeError):
    """`list(prefix, limit=n)` met more than n objects under the prefix (and stopped there)."""

    def __init__(self, prefix: str, limit: int):
        self.prefix, self.limit = prefix, limit
        super().__init__(f"more than {limit} objects under {prefix}")


@dataclass(frozen=True)
class BlobInfo:
    key: str
    size: int
    generation: int
    # When the store made this generation of the object (seconds since the epoch), as the
    # store itself records it (GCS: timeCreated, set by the server; local: the file's
    # modification time). None where unknown. Tells which of two identical objects came first.
    created: float | None = field(default=None, compare=False)


class BlobStore(abc.ABC):
    """Keys are '/'-separated paths relative to the store's root."""

    # How many independent small reads a caller may have in flight at once (`fan_out`): as
    # many as the backend serves in parallel without queueing them behind each other.
    read_concurrency: int = 1

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
    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        """Keys starting with `prefix`, sorted. `limit`: look at no more than this many
        objects; a prefix that holds more raises `ListingTooLong` (a bounded listing, for
        prefixes that a party the caller does not trust can fill)."""

    @abc.abstractmethod
    def delete(self, key: str, *, forget: bool = False) -> None:
        """Remove the object; absent is fine. `forget=True` promises the key is never written
        again with other bytes (a payload named by its content's hash): a backend may then
        drop what it keeps to tell the key's states apart (a local store's lock file)."""

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """Where the root is, e.g. a path or gs://bucket/prefix (for Orbax and for people)."""


class LocalBlobStore(BlobStore):
    """A directory. Generations do not come from the clock or the inode (an inode number is
    reused as soon as it is freed, and two writes can share a timestamp): each key has a lock
    file beside it, `.{name}.lock`, holding the key's mutation counter. Every write and delete
    takes that lock exclusively (an `flock`, so it holds across processes on one machine),
    checks any precondition, bumps the counter and only then renames (or unlinks) the object;
    `info` reads the counter and stats the object under the shared lock. An object's generation
    is its counter + 1, so no two states of a key share one. A lock file outlives its object:
    the counter does, and a key deleted and created again gets a fresh generation. Only a
    delete that `forget`s the key (a content-named payload pruned by retention, which nobody
    writes again with other bytes) removes the lock file too, still holding it: whoever opened
    the old file before it went finds, once it holds the lock, that the path names another
    file (or none) and opens it again (`_locked`), so two holders never lock different files
    for one key."""

    # A local read is a few system calls and parsing happens under the interpreter lock: a
    # few threads overlap the calls (and a network filesystem's round trips), more only queue.
    read_concurrency = 4

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
    def _lock_path(path: Path) -> Path:
        return path.parent / f".{path.name}.lock"

    @staticmethod
    def _counter(fd: int, lock: Path) -> int:
        """The key's mutation count, read from its open lock file (empty: no mutation yet, or an
        object written before the counter existed)."""
        raw = os.pread(fd, 32, 0).strip()
        if not raw:
            return 0
        if not raw.isdigit():
            raise RuntimeError(f"{lock}: corrupt generation counter {raw[:32]!r}")
        return int(raw)

    @staticmethod
    def _stat(key: str, path: Path, counter: int) -> BlobInfo | None:
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None
        return BlobInfo(key, stat.st_size, counter + 1, stat.st_mtime)

    @contextlib.contextmanager
    def _mutating(self, key: str, path: Path):
        """Hold the key's lock exclusively; yield (the current generation, 0 if absent; `bump`,
        which records one more mutation and returns the generation the object has once the
        caller's rename lands). Bump only a change that will happen (a failed precondition
        must not move the generation under the winner), and bump before making it: a crash
        between the two leaves a new generation over unchanged bytes, a spurious change that a
        conditional writer retries, never a stale match."""
        lock = self._lock_path(path)
        fd = self._locked(lock, fcntl.LOCK_EX, create=True)
        try:
            counter = self._counter(fd, lock)
            current = self._stat(key, path, counter)

            def bump() -> int:
                # Not fsynced: the counter must be exact for live processes, which share the
                # page cache; after a power loss nobody holds a generation read before it.
                body = b"%d\n" % (counter + 1)
                if os.pwrite(fd, body, 0) != len(body):
                    raise OSError(f"{lock}: short write of the generation counter")
                return counter + 2

            def forget() -> None:
                lock.unlink()       # under the lock: see the class docstring

            yield (current.generation if current else 0), bump, forget
        finally:
            os.close(fd)  # releases the flock

    @staticmethod
    def _locked(lock: Path, operation: int, *, create: bool) -> int | None:
        """An open descriptor of `lock`, holding `operation` (shared or exclusive) on the file
        the path names once the lock is held: a lock file removed (`forget`) between the open
        and the lock is opened again. None when it is absent and `create` is False."""
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT if create else os.O_RDONLY, 0o644)
            except FileNotFoundError:
                if create:
                    raise
                return None
            try:
                fcntl.flock(fd, operation)
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass        # removed while we waited: open it (or learn it is gone) again
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def write(self, key: str, data: bytes, *, if_generation: int | None = None) -> BlobInfo:
        path = self._path(key)
        # The bytes go to a temporary file first; only the check, the counter and the rename
        # are under the lock.
        fd, tmp = self._temporary(path)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            with self._mutating(key, path) as (current, bump, _):
                if if_generation is not None and current != if_generation:
                    raise PreconditionFailed(
                        f"{key}: generation is {current}, expected {if_generation}")
                generation = bump()
                os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return BlobInfo(key, len(data), generation)

    def read(self, key: str) -> bytes:
        try:
            # Non-blocking: a FIFO a learner put where its record goes would block a plain
            # open until someone writes to it (the reader's whole tick with it).
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise BlobNotFound(key) from None
        with os.fdopen(fd, "rb") as file:
            # Only regular files are objects of this store (it writes nothing else).
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BlobNotFound(key)
            return file.read()

    def info(self, key: str) -> BlobInfo | None:
        path = self._path(key)
        lock = self._lock_path(path)
        fd = self._locked(lock, fcntl.LOCK_SH, create=False)
        if fd is None:
            # Never mutated here, or being created right now: then generation 1 is stale but
            # cannot match, since that creation bumped the counter past 0 first. (Or forgotten:
            # its object is gone too.)
            return self._stat(key, path, 0)
        try:
            return self._stat(key, path, self._counter(fd, lock))
        finally:
            os.close(fd)

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        # Walk only the deepest directory the prefix names: a prefix listing, not a tree scan.
        base = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        walked = 0
        for path in base.rglob("*"):
            if not path.is_file():
                continue
            walked += 1
            # Hidden files (a lock file beside each object, temporary files) are walked too:
            # past twice the limit of them, the walk stops as well.
            if limit is not None and walked > 2 * limit + 16:
                raise ListingTooLong(prefix, limit)
            if not path.name.startswith("."):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
                    if limit is not None and len(keys) > limit:
                        raise ListingTooLong(prefix, limit)
        return sorted(keys)

    def _temporary(self, path: Path) -> tuple[int, str]:
        """A new temporary file beside `path`, its directories made. The directory can vanish
        between the two (a forgetting delete took the last object out of it): made again."""
        for _ in range(100):
            try:
                # mkdir itself races a removal (it can find the directory made, then gone).
                path.parent.mkdir(parents=True, exist_ok=True)
                return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            except (FileNotFoundError, FileExistsError):
                continue
        raise OSError(f"{path.parent}: removed again each time it was made")

    def delete(self, key: str, *, forget: bool = False) -> None:
        path = self._path(key)
        if not path.exists():
            return  # absent at this instant: done, and no lock file left behind
        try:
            with self._mutating(key, path) as (current, bump, drop_lock):
                if current:
                    bump()
                    path.unlink()
                if forget:
                    drop_lock()
        except FileNotFoundError:
            return  # its directory went with another key's forgetting delete: gone too
        if forget:
            self._remove_empty_directories(path.parent)

    def _remove_empty_directories(self, directory: Path) -> None:
        """A forgotten key leaves nothing behind, not even its directories once they are empty
        (a round's: eighteen a round, an inode each, for ever). A writer's temporary file
        keeps a directory in use from being removed; one made again is `_temporary`'s."""
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:       # not empty (or gone): its parents are not empty either
                return
            directory = directory.parent
