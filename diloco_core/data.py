"""Byte-level data: stable file-to-shard assignment, document packing and seeded batch order.

A document's tokens are its raw bytes (vocabulary 256). Files are assigned to the held-out set or
to one of M learner shards by a SHA-256 hash of their relative path, so every process and machine
agrees on the split without coordinating. A shard is one packed uint8 stream; `BatchIterator` cuts
it into non-overlapping windows of `seq_len` tokens and serves them in a seeded, per-epoch
shuffled order whose position is a few integers that checkpoint and restore exactly.
"""

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np

# NUL never occurs in text or source files, so it marks document boundaries unambiguously while
# staying inside the 256-byte vocabulary (no extra token id, no embedding resize).
SEPARATOR = 0x00

_HASH_DENOMINATOR = float(2**64)


def assign_split(rel_path: str, num_learners: int, heldout_fraction: float) -> int | None:
    """The learner shard 0..M-1 of file `rel_path`, or None if it belongs to the held-out set.

    Stable everywhere: hashlib SHA-256 of the UTF-8 path with "/" separators (never Python's
    salted hash()). The first 8 digest bytes decide held-out with probability `heldout_fraction`;
    the next 8 pick the shard uniformly (modulo bias ~ M / 2**64, negligible).
    """
    if num_learners < 1:
        raise ValueError(f"num_learners must be >= 1, got {num_learners}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    digest = hashlib.sha256(rel_path.replace("\\", "/").encode("utf-8")).digest()
    if int.from_bytes(digest[:8], "big") / _HASH_DENOMINATOR < heldout_fraction:
        return None
    return int.from_bytes(digest[8:16], "big") % num_learners


def pack_documents(docs: Iterable[bytes]) -> np.ndarray:
    """One uint8 token stream: the non-empty documents joined by a single SEPARATOR byte."""
    # Empty documents are dropped so they cannot produce runs of separators.
    joined = bytes([SEPARATOR]).join(d for d in docs if d)
    return np.frombuffer(bytearray(joined), dtype=np.uint8)  # bytearray: a writable array


def _require_tokens(stream: np.ndarray, needed: int, what: str) -> None:
    if stream.ndim != 1:
        raise ValueError(f"token stream must be 1-D, got shape {stream.shape}")
    if stream.size < needed:
        raise ValueError(f"token stream has {stream.size} tokens, fewer than {what} "
                         f"({needed} tokens); use a larger corpus or smaller batch_size/seq_len")


def _check_sizes(batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")


class ShuffledBatches:
    """Endless batches of row indices 0..num_rows-1, reshuffled every epoch.

    Each epoch permutes the rows with PCG64 seeded from (seed, epoch) and serves
    `batches_per_epoch` full batches (the few rows left over by the batch size are skipped that
    epoch, a different few each epoch). `state()` is three ints; restoring it resumes bit for
    bit. Subclasses turn the rows into a batch (`next`).
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int,
                 state: Mapping[str, int] | None):
        self.batch_size, self.seed = batch_size, int(seed)
        self.num_rows = num_rows
        self.batches_per_epoch = num_rows // batch_size
        self.epoch, self.position = 0, 0
        self._order: np.ndarray | None = None  # permutation of the current epoch, built lazily
        if state is not None:
            self.restore(state)

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, self.epoch]))
            self._order = rng.permutation(self.num_rows)
        return self._order

    def _next_rows(self) -> np.ndarray:
        """The next batch's rows; advances the position."""
        start = self.position * self.batch_size
        rows = self._epoch_order()[start:start + self.batch_size]
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return rows

    def next(self):
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self):
        return self.next()

    def state(self) -> dict[str, int]:
        """Where the iterator stands, as plain JSON-serialisable ints."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def restore(self, state: Mapping[str, int]) -> None:
        """Continue from `state` (from `state()` of an iterator over the same data and seed)."""
        seed, epoch, position = (int(state[k]) for k in ("seed", "epoch", "position"))
        if seed != self.seed:
            raise ValueError(f"state is for seed {seed}, but this iterator has seed {self.seed}")
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise ValueError(f"state epoch={epoch}, position={position} is out of range "
                             f"(batches_per_epoch={self.batches_per_epoch}); was it saved "
                             "for different data or batch sizes?")
        if epoch != self.epoch:
            self._order = None
        self.epoch, self.position = epoch, position


class BatchIterator(ShuffledBatches):
    """Endless int32 batches [batch_size, seq_len] of packed windows, shuffled per epoch.

    The stream is cut into windows starting at multiples of `seq_len`; the windows are the rows
    shuffled per epoch (`ShuffledBatches`). An iterator built or restored from `state()` yields
    bitwise-identical next batches.
    """

    def __init__(self, stream: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
                 state: Mapping[str, int] | None = None):
        _check_sizes(batch_size, seq_len)
        stream = np.asarray(stream)
        _require_tokens(stream, batch_size * seq_len, "one batch of batch_size * seq_len")
        self.seq_len = seq_len
        num_windows = stream.size // seq_len
        self._windows = stream[:num_windows * seq_len].reshape(num_windows, seq_len)
        super().__init__(num_windows, batch_size, seed, state)

    @property
    def num_windows(self) -> int:
        return self._windows.shape[0]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def next(self) -> np.ndarray:
        """The next batch, int32 [batch_size, seq_len]; advances the position."""
        # Fancy indexing copies: the caller owns the batch.
        return self._windows[self._next_rows()].astype(np.int32)


def heldout_batches(stream: np.ndarray, batch_size: int, seq_len: int,
                    num_batches: int) -> np.ndarray:
    """The first num_batches * batch_size windows of `stream`, unshuffled: int32 [N, B, L]."""
    _check_sizes(batch_size, seq_len)
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    stream = np.asarray(stream)
    needed = num_batches * batch_size * seq_len
    _require_tokens(stream, needed, f"{num_batches} held-out batches of {batch_size} x {seq_len}")
    return stream[:needed].reshape(num_batches, batch_size, seq_len).astype(np.int32)
