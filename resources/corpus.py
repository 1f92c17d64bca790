"""The training corpus on local disk: list files, split them across learners, pack the bytes.

"stdlib" is the running interpreter's own standard-library source (every `*.py`, no third-party
packages): a few thousand files and tens of MB, on every machine with Python, no download. Any
other value is a glob of local text files. Splitting and packing are pure and live in
`diloco_core.data`; this module only does the file I/O around them.
"""

import functools
import glob
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diloco_core.data import assign_split, pack_documents

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The standard-library source directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[tuple[str, Path]]:
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of third-party packages entirely.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        base = Path(dirpath)
        for name in filenames:
            if name.endswith(".py"):
                path = base / name
                found.append((path.relative_to(root).as_posix(), path))
    return found


def _glob_base(pattern: str) -> Path:
    """The directory made of the pattern's leading non-magic components."""
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:  # the last component names files, never the base
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _glob_files(pattern: str) -> list[tuple[str, Path]]:
    pattern = os.path.expanduser(pattern)
    base = _glob_base(pattern)
    found = []
    for match in glob.glob(pattern, recursive=True):
        path = Path(match)
        if path.is_file():
            found.append((Path(os.path.relpath(path, base)).as_posix(), path))
    return found


def list_corpus_files(corpus: str) -> list[tuple[str, Path]]:
    """(relative path with "/" separators, absolute-or-given path) of every corpus file, sorted.

    `corpus` is "stdlib" or a glob of local files (`**` recurses; relative paths are taken from
    the glob's leading non-magic directory).
    """
    if "://" in corpus:
        raise NotImplementedError(f"corpus {corpus!r}: remote corpora (gs:// and other URLs) are "
                                  "not supported yet; use 'stdlib' or a glob of local files")
    files = _stdlib_files() if corpus == "stdlib" else _glob_files(corpus)
    if not files:
        where = f"under {stdlib_root()}" if corpus == "stdlib" else "on local disk"
        raise ValueError(f"corpus {corpus!r} matches no files {where}")
    return sorted(files)


@dataclass(frozen=True, eq=False)
class CorpusSplit:
    """Files and packed uint8 token streams per learner shard and for the held-out set.

    Streams are read-only: the split is cached and shared by every caller in the process.
    """

    learner_files: tuple[tuple[str, ...], ...]
    heldout_files: tuple[str, ...]
    learner_streams: tuple[np.ndarray, ...]
    heldout_stream: np.ndarray

    @property
    def num_learners(self) -> int:
        return len(self.learner_streams)

    def summary(self) -> dict:
        """Files and bytes (tokens, after any truncation) per split, JSON-serialisable."""
        return {
            "num_learners": self.num_learners,
            "learner_files": [len(f) for f in self.learner_files],
            "learner_bytes": [int(s.size) for s in self.learner_streams],
            "heldout_files": len(self.heldout_files),
            "heldout_bytes": int(self.heldout_stream.size),
        }


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:  # unreadable (permissions, broken link, vanished): not part of the corpus
        return None


def _pack(docs: list[bytes], max_bytes: int | None) -> np.ndarray:
    stream = pack_documents(docs)
    if max_bytes is not None:
        stream = stream[:max_bytes]
    stream.setflags(write=False)
    return stream


def load_corpus(corpus: str, num_learners: int, heldout_fraction: float,
                max_bytes_per_split: int | None = None) -> CorpusSplit:
    """Read the corpus, assign files with `assign_split` and pack each split (cached per process).

    `max_bytes_per_split` keeps only the first that many tokens of each stream (for fast tests).
    Raises ValueError if a learner shard or the held-out set would get no data.
    """
    if not isinstance(num_learners, int) or num_learners < 1:
        raise ValueError(f"num_learners must be an integer >= 1, got {num_learners!r}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    if max_bytes_per_split is not None and max_bytes_per_split < 1:
        raise ValueError(f"max_bytes_per_split must be >= 1 or None, got {max_bytes_per_split!r}")
    return _load_corpus(corpus, num_learners, float(heldout_fraction), max_bytes_per_split)


@functools.lru_cache(maxsize=8)
def _load_corpus(corpus: str, num_learners: int, heldout_fraction: float,
                 max_bytes_per_split: int | None) -> CorpusSplit:
    files = list_corpus_files(corpus)
    shard_files: list[list[str]] = [[] for _ in range(num_learners)]
    shard_docs: list[list[bytes]] = [[] for _ in range(num_learners)]
    heldout_files: list[str] = []
    heldout_docs: list[bytes] = []
    for rel, path in files:
        data = _read(path)
        if data is None:
            continue
        split = assign_split(rel, num_learners, heldout_fraction)
        names, docs = (heldout_files, heldout_docs) if split is None else \
            (shard_files[split], shard_docs[split])
        names.append(rel)
        docs.append(data)
    n = len(files)
    for i, names in enumerate(shard_files):
        if not names:
            raise ValueError(f"corpus {corpus!r}: learner shard {i} of {num_learners} got no "
                             f"file ({n} files in all); too few files for that many learners")
    if not heldout_files:
        raise ValueError(f"corpus {corpus!r}: no file of {n} fell in the held-out set "
                         f"(heldout_fraction={heldout_fraction}); add files or raise the fraction")
    split = CorpusSplit(
        learner_files=tuple(tuple(f) for f in shard_files),
        heldout_files=tuple(heldout_files),
        learner_streams=tuple(_pack(d, max_bytes_per_split) for d in shard_docs),
        heldout_stream=_pack(heldout_docs, max_bytes_per_split),
    )
    empty = [name for name, s in zip(
        [f"learner shard {i}" for i in range(num_learners)] + ["held-out set"],
        [*split.learner_streams, split.heldout_stream], strict=True) if s.size == 0]
    if empty:
        raise ValueError(f"corpus {corpus!r}: {', '.join(empty)} got only empty files")
    return split
