"""Outer-gradient wire encodings: round-trip bounds, zero blocks, exact byte counts, shapes."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from diloco_core.compression import decode, encode, encoded_nbytes

INT_QMAX = {"int8": 127, "int4": 7, "int2": 1}


def _data(kind: str, shape=(4099,)) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    return (rng.standard_t(1.5, shape) * 1e-3).astype(np.float32)  # heavy tails, outliers


@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_fp32_is_exact(kind):
    x = _data(kind)
    np.testing.assert_array_equal(np.asarray(decode(encode(x, "fp32"))), x)


@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_bf16_relative_error_bound(kind):
    x = _data(kind)
    e = encode(x, "bf16")
    assert e.payload.dtype == ml_dtypes.bfloat16 and e.scales is None
    err = np.abs(np.asarray(decode(e)) - x)
    assert np.all(err <= 2.0**-8 * np.abs(x))


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("encoding", ["int8", "int4", "int2"])
@pytest.mark.parametrize("block_size", [64, 7])
def test_int_error_bound_is_half_a_step(encoding, kind, block_size):
    x = _data(kind)
    e = encode(x, encoding, block_size)
    x_hat = np.asarray(decode(e))
    pad = -x.size % block_size
    absmax = np.abs(np.pad(x, (0, pad))).reshape(-1, block_size).max(axis=1)
    np.testing.assert_allclose(np.asarray(e.scales), absmax / INT_QMAX[encoding], rtol=1e-6)
    bound = np.repeat(absmax / (2 * INT_QMAX[encoding]), block_size)[:x.size]
    assert np.all(np.abs(x_hat - x) <= bound * (1 + 1e-5) + 1e-30)
    # The block absmax itself is representable: q = +-qmax exactly.
    i = int(np.argmax(np.abs(x)))
    assert math.isclose(x_hat[i], x[i], rel_tol=1e-6)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "int8", "int4", "int2"])
def test_zero_blocks_decode_to_exact_zeros(encoding):
    x = np.zeros(200, np.float32)
    x[150:] = np.linspace(-1, 1, 50)  # blocks 0 and 1 are all zero, the rest are not
    x_hat = np.asarray(decode(encode(x, encoding, 64)))
    assert np.all(np.isfinite(x_hat))
    np.testing.assert_array_equal(x_hat[:128], 0.0)


@pytest.mark.parametrize("encoding", ["int8", "int4", "int2", "bf16"])
def test_non_finite_values_stay_non_finite(encoding):
    x = np.ones(100, np.float32)
    x[3] = np.nan
    assert not np.all(np.isfinite(np.asarray(decode(encode(x, encoding)))))


def test_int4_example_byte_count():
    e = encode(np.ones(1000, np.float32), "int4", 64)
    assert e.payload.dtype == np.uint8 and e.payload.shape == (512,)  # 2 codes per byte
    assert e.scales.dtype == np.float32 and e.scales.shape == (16,)
    assert e.nbytes == 512 + 16 * 4 == 576 == encoded_nbytes(1000, "int4", 64)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("n,block_size", [(1, 64), (1000, 64), (4096, 64), (1001, 7), (5, 1)])
def test_nbytes_is_exact_and_matches_the_planner(encoding, n, block_size):
    e = encode(np.linspace(-1, 1, n, dtype=np.float32), encoding, block_size)
    payload = np.asarray(e.payload)
    scales = 0 if e.scales is None else np.asarray(e.scales).nbytes
    assert e.nbytes == payload.nbytes + scales == encoded_nbytes(n, encoding, block_size)
    if encoding in INT_QMAX:
        bits = {"int8": 8, "int4": 4, "int2": 2}[encoding]
        blocks = math.ceil(n / block_size)
        assert payload.size == math.ceil(blocks * block_size * bits / 8)
        assert e.scales.shape == (blocks,)


def test_int2_packs_four_codes_per_byte():
    x = np.array([-1, 0, 1, 1, 0, 0, -1, -1], np.float32)
    e = encode(x, "int2", 8)
    # Offset-binary codes 0, 1, 2, 2 | 1, 1, 0, 0, lowest bits first.
    assert np.asarray(e.payload).tolist() == [0 | 1 << 2 | 2 << 4 | 2 << 6, 1 | 1 << 2]
    np.testing.assert_array_equal(np.asarray(decode(e)), x)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("shape", [(), (37,), (5, 13), (2, 3, 11)])
def test_shape_and_dtype_preserved(encoding, shape):
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    e = encode(jnp.asarray(x), encoding, 16)
    x_hat = decode(e)
    assert e.shape == shape and x_hat.shape == shape and x_hat.dtype == jnp.float32


def test_rejects_unknown_encoding_and_bad_block_size():
    with pytest.raises(ValueError, match="int3"):
        encode(np.ones(3), "int3")
    with pytest.raises(ValueError, match="block_size"):
        encode(np.ones(3), "int8", 0)
    with pytest.raises(ValueError, match="fp16"):
        encoded_nbytes(3, "fp16", 64)
