"""Held-out slices that can tell two training arms apart: validation (for tuning) and test (for
reporting), disjoint, each spread over the whole held-out stream, the same for every arm.

Selection (deterministic, no randomness): V + T non-overlapping windows of one batch
(batch_size x seq_len tokens) start at evenly spaced offsets from the stream's first token to
its last full batch; the windows then alternate between the two slices (validation first), in
proportion V : T where the sizes differ. The first 8 KB the simulator scores during training
(`heldout_batches`) is the stream's start, so it overlaps the first validation window only.

Why interleaved, not the two halves of the stream: the held-out set is a few dozen files, one
of them about 40% of the tokens (the standard library's corpus at the 5% split), so each half
would sample a different mix of files and the two slices would measure different things (the
first 8 KB alone is about 0.1 nat harder than the rest). Interleaved, both sample the same mix
and a choice made on validation carries over to test. The price: neighbouring windows often
come from the same file, so the two slices' sampling errors are correlated; the fresh
confirmation seeds, not the text, are what make a reported figure independent of the selection.
Likewise a standard error over batches treats neighbouring windows as independent and so
understates the text's sampling error somewhat.
"""

import numpy as np

VALIDATION, TEST = "validation", "test"


def spread_offsets(stream_size: int, span: int, count: int) -> np.ndarray:
    """`count` start offsets of `span`-token windows, evenly spaced from 0 to the last full
    window, never overlapping: int64 [count]."""
    if span < 1 or count < 1:
        raise ValueError(f"span and count must be >= 1, got {span} and {count}")
    if stream_size < count * span:
        raise ValueError(f"held-out stream of {stream_size} tokens cannot hold {count} "
                         f"disjoint windows of {span} tokens; use fewer eval batches")
    # floor(i (size - span) / (count - 1)) in integers (exact, unlike a float linspace):
    # consecutive floors differ by at least floor(gap) >= span when size >= count * span.
    last = stream_size - span
    return np.arange(count, dtype=np.int64) * last // max(count - 1, 1)


def spread_batches(stream: np.ndarray, batch_size: int, seq_len: int,
                   num_batches: int) -> np.ndarray:
    """`num_batches` batches of batch_size x seq_len tokens at evenly spaced offsets over the
    whole stream: int32 [N, B, L]."""
    stream = np.asarray(stream)
    span = batch_size * seq_len
    offsets = spread_offsets(stream.size, span, num_batches)
    return _windows(stream, offsets, batch_size, seq_len)


def _windows(stream: np.ndarray, offsets: np.ndarray, batch_size: int,
             seq_len: int) -> np.ndarray:
    span = batch_size * seq_len
    return np.stack([stream[o:o + span].reshape(batch_size, seq_len)
                     for o in offsets]).astype(np.int32)


def slice_roles(validation_batches: int, test_batches: int) -> list[str]:
    """Which slice each of the V + T evenly spaced windows goes to, in stream order: the
    windows alternate, test taking window i whenever floor((i + 1) T / (V + T)) steps up, so
    both slices stay spread however unequal their sizes."""
    if validation_batches < 1 or test_batches < 1:
        raise ValueError(f"both slices need >= 1 batch, got {validation_batches} and "
                         f"{test_batches}")
    total = validation_batches + test_batches
    return [TEST if (i + 1) * test_batches // total > i * test_batches // total else VALIDATION
            for i in range(total)]


def heldout_slices(stream: np.ndarray, batch_size: int, seq_len: int, validation_batches: int,
                   test_batches: int) -> dict[str, np.ndarray]:
    """{"validation": int32 [V, B, L], "test": int32 [T, B, L]}: disjoint, interleaved, each
    spread over the whole stream (see the module docstring)."""
    roles = slice_roles(validation_batches, test_batches)
    stream = np.asarray(stream)
    offsets = spread_offsets(stream.size, batch_size * seq_len, len(roles))
    return {name: _windows(stream, offsets[[r == name for r in roles]], batch_size, seq_len)
            for name in (VALIDATION, TEST)}


def slice_offsets(stream_size: int, batch_size: int, seq_len: int, validation_batches: int,
                  test_batches: int) -> dict[str, np.ndarray]:
    """The start offsets of each slice's batches (what `heldout_slices` cuts), for records."""
    roles = slice_roles(validation_batches, test_batches)
    offsets = spread_offsets(stream_size, batch_size * seq_len, len(roles))
    return {name: offsets[[r == name for r in roles]] for name in (VALIDATION, TEST)}
