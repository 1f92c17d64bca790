"""The validation and test slices (issue 38): disjoint, spread, deterministic, sized as asked."""

import numpy as np
import pytest

from diloco_core.eval_slices import (
    TEST,
    VALIDATION,
    heldout_slices,
    slice_offsets,
    slice_roles,
    spread_batches,
    spread_offsets,
)

B, L = 2, 8
SPAN = B * L


def _stream(size: int) -> np.ndarray:
    # Distinct-ish tokens per position, so windows can be told apart by content.
    return (np.arange(size) % 251).astype(np.uint8)


def _covered(offsets) -> set[int]:
    return {t for o in offsets for t in range(int(o), int(o) + SPAN)}


@pytest.mark.parametrize("sizes", [(100, 100), (100, 130), (7, 3), (1, 1)])
def test_slices_are_disjoint_and_sized_as_asked(sizes):
    v, t = sizes
    offsets = slice_offsets(40_000, B, L, v, t)
    assert len(offsets[VALIDATION]) == v and len(offsets[TEST]) == t
    assert not _covered(offsets[VALIDATION]) & _covered(offsets[TEST])
    # No window overlaps another of its own slice either: every token scored once.
    for name in (VALIDATION, TEST):
        assert len(_covered(offsets[name])) == SPAN * len(offsets[name])
    batches = heldout_slices(_stream(40_000), B, L, v, t)
    assert batches[VALIDATION].shape == (v, B, L) and batches[TEST].shape == (t, B, L)
    assert batches[TEST].dtype == np.int32


def test_each_slice_spans_the_whole_stream():
    size = 40_000
    offsets = slice_offsets(size, B, L, 100, 100)
    gap = (size - SPAN) / 199  # between neighbouring windows of either slice
    for name in (VALIDATION, TEST):
        o = offsets[name]
        assert o[0] <= gap + 1 and o[-1] >= size - SPAN - gap - 1
        # Evenly: no stretch of the stream is left out (at most two windows' gap apart).
        assert np.diff(o).max() <= 2 * gap + 1


def test_validation_and_test_are_different_text():
    s = heldout_slices(_stream(40_000), B, L, 100, 100)
    assert not np.array_equal(s[VALIDATION], s[TEST])
    assert s[VALIDATION][0, 0, 0] == 0  # the first window is the stream's start


def test_selection_is_deterministic():
    a = heldout_slices(_stream(40_000), B, L, 100, 100)
    b = heldout_slices(_stream(40_000), B, L, 100, 100)
    for name in (VALIDATION, TEST):
        np.testing.assert_array_equal(a[name], b[name])


def test_unequal_sizes_interleave_rather_than_clump():
    roles = slice_roles(3, 6)
    assert roles.count(VALIDATION) == 3 and roles.count(TEST) == 6
    # Validation windows are spread out (one in every three), not bunched at one end.
    assert roles == [VALIDATION, TEST, TEST, VALIDATION, TEST, TEST, VALIDATION, TEST, TEST]
    assert slice_roles(2, 2) == [VALIDATION, TEST, VALIDATION, TEST]


def test_a_stream_too_short_for_disjoint_windows_is_refused():
    with pytest.raises(ValueError, match="disjoint"):
        heldout_slices(_stream(SPAN * 10 - 1), B, L, 5, 5)
    heldout_slices(_stream(SPAN * 10), B, L, 5, 5)  # exactly enough


def test_offsets_are_exactly_evenly_spaced_and_never_overlap():
    # A size where float spacing lands just under a multiple of the span.
    for size, count in ((SPAN * 7, 7), (1_804_884, 881), (1_804_884, 96)):
        o = spread_offsets(size, SPAN, count)
        assert o[0] == 0 and o[-1] == size - SPAN and np.diff(o).min() >= SPAN
    with pytest.raises(ValueError):
        slice_roles(0, 5)


def test_spread_batches_cuts_the_windows_at_the_offsets():
    stream = _stream(10_000)
    got = spread_batches(stream, B, L, 4)
    for batch, offset in zip(got, spread_offsets(10_000, SPAN, 4), strict=True):
        np.testing.assert_array_equal(batch.ravel(), stream[offset:offset + SPAN])
