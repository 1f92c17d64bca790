"""Wire encodings for outer gradients: fp32, bf16 and block-wise absmax int8 / int4 / int2.

Integer encodings flatten the tensor, pad it with zeros to a multiple of `block_size`, and per
block store one float32 scale s = max|x| / qmax, qmax = 2**(bits-1) - 1 (127, 7, 1), plus codes
q = clip(round(x / s), -qmax, qmax) kept offset-binary (q + qmax, unsigned) and bit-packed:
int8 one per byte, int4 two per byte (low nibble first), int2 four per byte (lowest bits first).
An all-zero block has s = 0 and decodes to exact zeros (no 0/0).

Error bounds per value (up to float32 rounding of the scale and the division):
  - fp32: exact.
  - bf16: round-to-nearest-even, |x - x_hat| <= 2**-8 |x| for normal-range values.
  - intN: |x - x_hat| <= s / 2 = absmax_block / (2 qmax); so int2 keeps only sign and
    "at least half the block's absmax" per value.
A non-finite input poisons its block (the block decodes to NaN or Inf), so a receiver's
finiteness check on the decoded tensor still catches it.

`nbytes` counts wire bytes exactly: payload plus scales, metadata (encoding, shape) excluded;
`encoded_nbytes` computes the same number from the value count alone.
"""

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from diloco_core.config import ENCODINGS

_BITS = {"int8": 8, "int4": 4, "int2": 2}
_VALUE_BYTES = {"fp32": 4, "bf16": 2}
_SCALE_BYTES = 4  # float32 per block


@dataclass(frozen=True, eq=False)
class Encoded:
    """One tensor as it travels: codes or floats in `payload`, per-block `scales` (intN only)."""

    encoding: str
    shape: tuple[int, ...]
    block_size: int
    payload: jax.Array        # float32 | bfloat16 (original shape) | uint8 packed codes (1-D)
    scales: jax.Array | None  # float32 [num_blocks] for intN, else None

    @property
    def nbytes(self) -> int:
        """Exact wire bytes: payload plus scales."""
        scale_bytes = 0 if self.scales is None else int(self.scales.nbytes)
        return int(self.payload.nbytes) + scale_bytes

    @property
    def num_values(self) -> int:
        return math.prod(self.shape)


def _check(encoding: str, block_size: int) -> None:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")


def _packed_codes(num_values: int, bits: int, block_size: int) -> tuple[int, int]:
    """(number of blocks, number of codes after padding to whole blocks and whole bytes)."""
    num_blocks = -(-num_values // block_size)
    per_byte = 8 // bits
    codes = -(-(num_blocks * block_size) // per_byte) * per_byte
    return num_blocks, codes


def encoded_nbytes(num_values: int, encoding: str, block_size: int) -> int:
    """Wire bytes of `encode` on `num_values` values, without encoding anything."""
    _check(encoding, block_size)
    if encoding in _VALUE_BYTES:
        return num_values * _VALUE_BYTES[encoding]
    bits = _BITS[encoding]
    num_blocks, codes = _packed_codes(num_values, bits, block_size)
    return codes * bits // 8 + num_blocks * _SCALE_BYTES


@partial(jax.jit, static_argnames=("bits", "block_size"))
def _quantize(flat: jax.Array, bits: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    qmax = 2 ** (bits - 1) - 1
    num_blocks, codes = _packed_codes(flat.shape[0], bits, block_size)
    blocks = jnp.pad(flat, (0, num_blocks * block_size - flat.shape[0]))
    blocks = blocks.reshape(num_blocks, block_size)
    scales = jnp.max(jnp.abs(blocks), axis=1) / qmax
    # Zero blocks divide by 1 instead of 0; their codes are 0 and decode to 0 * 0 = 0.
    safe = jnp.where(scales > 0, scales, 1.0)[:, None]
    q = jnp.clip(jnp.round(blocks / safe), -qmax, qmax)
    unsigned = (q + qmax).astype(jnp.uint8).reshape(-1)
    # Padding codes up to a whole byte use the code of 0 (offset qmax).
    unsigned = jnp.pad(unsigned, (0, codes - unsigned.shape[0]), constant_values=qmax)
    per_byte = 8 // bits
    lanes = unsigned.reshape(-1, per_byte)
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    # Lanes occupy disjoint bit ranges, so the sum is a bitwise OR.
    payload = jnp.sum(lanes << shifts[None, :], axis=1, dtype=jnp.uint8)
    return payload, scales.astype(jnp.float32)


@partial(jax.jit, static_argnames=("bits", "block_size", "num_values"))
def _dequantize(payload: jax.Array, scales: jax.Array, bits: int, block_size: int,
                num_values: int) -> jax.Array:
    qmax = 2 ** (bits - 1) - 1
    per_byte = 8 // bits
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    mask = jnp.uint8(2**bits - 1)
    unsigned = ((payload[:, None] >> shifts[None, :]) & mask).reshape(-1)
    num_blocks = scales.shape[0]
    q = unsigned[:num_blocks * block_size].astype(jnp.float32) - qmax
    values = q.reshape(num_blocks, block_size) * scales[:, None]
    return values.reshape(-1)[:num_values]


def encode(x: jax.Array | np.ndarray, encoding: str, block_size: int = 64) -> Encoded:
    """Encode `x` (any shape, cast to float32) for the wire."""
    _check(encoding, block_size)
    x = jnp.asarray(x, dtype=jnp.float32)
    shape = tuple(int(d) for d in x.shape)
    if encoding == "fp32":
        return Encoded(encoding, shape, block_size, x, None)
    if encoding == "bf16":
        return Encoded(encoding, shape, block_size, x.astype(ml_dtypes.bfloat16), None)
    payload, scales = _quantize(x.reshape(-1), _BITS[encoding], block_size)
    return Encoded(encoding, shape, block_size, payload, scales)


def wire_problem(encoding: str, shape: tuple[int, ...], block_size: int,
                 payload_dtype: str, payload_shape: tuple[int, ...],
                 scales_dtype: str | None, scales_shape: tuple[int, ...] | None) -> str | None:
    """Why arrays of these dtypes and shapes are not the wire form of a tensor of `shape` under
    `encoding`, or None when they are. Checked before a byte is decoded: a byte count alone
    does not tell float64 from float32 or int8 codes from float32 values, and decoding the
    wrong dtype reshapes to the wrong element count (or raises) inside the merge."""
    if encoding not in ENCODINGS:
        return f"unknown encoding {str(encoding)[:40]!r}"
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        return f"block size must be an integer >= 1, got {str(block_size)[:40]}"
    shape, payload_shape = tuple(shape), tuple(payload_shape)
    if encoding in _VALUE_BYTES:
        dtype = "float32" if encoding == "fp32" else "bfloat16"
        expected = (dtype, shape, None, None)
    else:
        bits = _BITS[encoding]
        num_blocks, codes = _packed_codes(math.prod(shape), bits, block_size)
        expected = ("uint8", (codes * bits // 8,), "float32", (num_blocks,))
    got = (payload_dtype, payload_shape, scales_dtype,
           None if scales_shape is None else tuple(scales_shape))
    if got[:2] != expected[:2]:
        return (f"{encoding} payload must be {expected[0]}{list(expected[1])}, got "
                f"{str(payload_dtype)[:20]}{list(payload_shape)[:8]}")
    if got[2:] != expected[2:]:
        want = "no scales" if expected[2] is None else f"scales {expected[2]}{list(expected[3])}"
        have = ("no scales" if scales_dtype is None
                else f"scales {str(scales_dtype)[:20]}{list(got[3] or ())[:8]}")
        return f"{encoding} needs {want}, got {have}"
    return None


def encoded_problem(e: Encoded) -> str | None:
    """`wire_problem` of an `Encoded` as it stands."""
    scales = e.scales
    return wire_problem(e.encoding, e.shape, e.block_size, np.dtype(e.payload.dtype).name,
                        tuple(e.payload.shape), None if scales is None
                        else np.dtype(scales.dtype).name,
                        None if scales is None else tuple(scales.shape))


class WireError(ValueError):
    """Arrays that are not the wire form their metadata declares."""


def decode(e: Encoded) -> jax.Array:
    """The float32 tensor of the original shape that `e` stands for; `WireError` (before
    decoding anything) when the arrays are not the wire form of that shape and encoding."""
    problem = encoded_problem(e)
    if problem is not None:
        raise WireError(problem)
    if e.encoding in _VALUE_BYTES:
        return jnp.asarray(e.payload).astype(jnp.float32).reshape(e.shape)
    values = _dequantize(jnp.asarray(e.payload), jnp.asarray(e.scales), _BITS[e.encoding],
                         e.block_size, e.num_values)
    return values.reshape(e.shape)
