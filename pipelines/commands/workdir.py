"""The demo's working directory (DAGSTER_HOME, the store, the resolved config): created or
reused, and held by one demo at a time.

Two demos on one workdir would start two Dagster daemons on one SQLite home and two drivers
on one store; the second is refused. The hold is an `flock` on `demo.lock` in the workdir,
which the kernel releases when the holder exits however it exits (a killed demo leaves no
stale lock); the file holds the holder's pid, for the message.

Every way the directory cannot be used (a file in its place, no permission, a read-only
file system) is a `WorkdirError`: one line naming the path and the reason.
"""

import contextlib
import errno
import fcntl
import os
from pathlib import Path

import yaml

LOCK = "demo.lock"


class WorkdirError(Exception):
    """The workdir cannot be used; the message names the path and why."""


def os_reason(err: OSError) -> str:
    """`Permission denied`, `Read-only file system`, ...: the reason without errno noise."""
    return err.strerror or str(err)


def prepare(root: Path) -> None:
    """Create `root` (and its parents) or say why it cannot be."""
    if root.exists() and not root.is_dir():
        raise WorkdirError(f"cannot use {root} as the workdir: it is a file, not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        where = err.filename or root
        raise WorkdirError(f"cannot create the workdir {where}: {os_reason(err)}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise WorkdirError(f"cannot write in the workdir {root}: permission denied")


@contextlib.contextmanager
def held(root: Path):
    """Hold `root` for this process until the block ends; refused if another demo holds it."""
    path = root / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise WorkdirError(f"cannot write in the workdir {root}: {os_reason(err)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise WorkdirError(f"the workdir {root} is in use by another demo (pid {holder}); "
                               "watch that run with `diloco status`, or give another "
                               "--workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)     # releases the lock


def previous_experiment(root: Path) -> str | None:
    """The experiment an earlier demo ran in `root` (its `experiment.yaml`), so that running
    again on the same workdir resumes that experiment rather than starting one beside it."""
    try:
        mapping = yaml.safe_load((root / "experiment.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    name = mapping.get("name") if isinstance(mapping, dict) else None
    return name if isinstance(name, str) else None
