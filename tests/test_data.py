"""Byte-level data: stable split assignment, packing, the seeded iterator, held-out batches."""

import json

import numpy as np
import pytest

from diloco_core.data import (
    SEPARATOR,
    BatchIterator,
    assign_split,
    heldout_batches,
    pack_documents,
)


def test_assign_split_matches_values_computed_once():
    # Computed once with sha256; must never change across processes, machines or versions.
    assert assign_split("os.py", 4, 0.05) == 3
    assert assign_split("json/decoder.py", 4, 0.05) == 0
    assert assign_split("json/decoder.py", 4, 0.5) is None
    assert assign_split("email/mime/text.py", 7, 0.0) == 1
    assert assign_split("doc1.txt", 4, 0.05) is None
    assert assign_split("README", 4, 0.5) is None


def test_assign_split_normalises_backslashes():
    windows_path = "email\\mime\\text.py"
    assert assign_split(windows_path, 7, 0.0) == assign_split("email/mime/text.py", 7, 0.0)


def test_assign_split_fractions_are_roughly_right():
    paths = [f"pkg{i // 50}/module_{i}.py" for i in range(20_000)]
    splits = [assign_split(p, 4, 0.1) for p in paths]
    heldout = sum(s is None for s in splits) / len(paths)
    assert 0.09 < heldout < 0.11
    counts = np.bincount([s for s in splits if s is not None], minlength=4)
    assert counts.min() > 0.9 * counts.mean()


def test_assign_split_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_learners"):
        assign_split("a.py", 0, 0.1)
    with pytest.raises(ValueError, match="heldout_fraction"):
        assign_split("a.py", 2, 1.0)


def test_pack_documents_joins_with_separator_and_skips_empty():
    stream = pack_documents([b"ab", b"", b"c", b"de"])
    assert stream.dtype == np.uint8
    assert stream.tolist() == [97, 98, SEPARATOR, 99, SEPARATOR, 100, 101]
    assert pack_documents([]).size == 0


def _stream(n: int) -> np.ndarray:
    return (np.arange(n) % 251).astype(np.uint8)


def test_batches_have_shape_dtype_and_cover_every_window_once_per_epoch():
    seq_len, batch_size = 8, 4
    stream = _stream(8 * 32 + 5)  # 32 windows; the 5-token tail is never used
    it = BatchIterator(stream, batch_size, seq_len, seed=3)
    assert it.tokens_per_batch == 32 and it.batches_per_epoch == 8
    batches = [it.next() for _ in range(it.batches_per_epoch)]
    assert all(b.shape == (4, 8) and b.dtype == np.int32 for b in batches)
    # Every aligned window exactly once (all 32 windows of this stream are distinct).
    served = sorted(bytes(row.astype(np.uint8)) for b in batches for row in b)
    assert served == sorted(bytes(w) for w in stream[:256].reshape(32, 8))
    assert it.state() == {"seed": 3, "epoch": 1, "position": 0}


def test_epochs_are_shuffled_differently_and_seeds_differ():
    stream = _stream(4096)
    a = BatchIterator(stream, 4, 16, seed=0)
    first = np.stack([a.next() for _ in range(a.batches_per_epoch)])
    second = np.stack([a.next() for _ in range(a.batches_per_epoch)])
    assert not np.array_equal(first, second)
    b = BatchIterator(stream, 4, 16, seed=1)
    assert not np.array_equal(b.next(), first[0])
    assert np.array_equal(BatchIterator(stream, 4, 16, seed=0).next(), first[0])


@pytest.mark.parametrize("steps", [0, 3, 7, 8, 13])  # 8 batches per epoch: 7/8 straddle it
def test_restore_continues_bitwise_identically(steps):
    stream = np.random.default_rng(0).integers(0, 256, 8 * 32, dtype=np.uint8)
    it = BatchIterator(stream, 4, 8, seed=11)
    for _ in range(steps):
        it.next()
    state = json.loads(json.dumps(it.state()))
    assert all(type(v) is int for v in state.values())
    expected = [it.next() for _ in range(12)]
    for resumed in (BatchIterator(stream, 4, 8, seed=11, state=state),
                    _restored(stream, state)):
        got = [resumed.next() for _ in range(12)]
        assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))


def _restored(stream: np.ndarray, state: dict) -> BatchIterator:
    it = BatchIterator(stream, 4, 8, seed=11)
    for _ in range(5):
        it.next()  # a different position, then jump
    it.restore(state)
    return it


def test_restore_rejects_foreign_state():
    it = BatchIterator(_stream(1024), 4, 8, seed=0)
    with pytest.raises(ValueError, match="seed"):
        it.restore({"seed": 1, "epoch": 0, "position": 0})
    with pytest.raises(ValueError, match="out of range"):
        it.restore({"seed": 0, "epoch": 0, "position": 99})


def test_short_stream_raises():
    with pytest.raises(ValueError, match="fewer than one batch"):
        BatchIterator(_stream(31), 4, 8)
    with pytest.raises(ValueError, match="held-out"):
        heldout_batches(_stream(63), 2, 8, 4)


def test_heldout_batches_are_the_first_windows_in_order():
    stream = _stream(1000)
    h = heldout_batches(stream, 2, 8, 3)
    assert h.shape == (3, 2, 8) and h.dtype == np.int32
    np.testing.assert_array_equal(h.reshape(-1), stream[:48])
    np.testing.assert_array_equal(h, heldout_batches(stream, 2, 8, 3))
