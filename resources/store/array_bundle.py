"""Array bundles: named arrays in one plain `.npz` object, with a checksum.

Why `.npz` and not Orbax/TensorStore for contributions and global fragments: each is a small,
write-once set of arrays that must be readable by anyone with numpy (`np.load(...,
allow_pickle=False)` never unpickles), verified by a SHA-256 before use, and written in a
single object so that it appears whole or not at all. Orbax is used where it shines: learner
checkpoints (`checkpoints.py`), with their optimizer state and restore into abstract targets.

Dtypes numpy's format cannot describe (bfloat16) are stored as same-width unsigned integers and
their real dtype is recorded in the manifest, so plain numpy readers get the raw bits and a note.
"""

import hashlib
import io
import math
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

_VIEW_AS = {"bfloat16": np.uint16}
_NATIVE = {"float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
           "uint32", "uint64", "bool"}


class BadBundle(ValueError):
    """A stored bundle that cannot be trusted: wrong size or checksum, not arrays, wrong shape."""


@dataclass(frozen=True)
class Bundle:
    data: bytes
    sha256: str
    dtypes: dict[str, str]              # array name -> dtype name
    shapes: dict[str, list[int]]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_bundle(arrays: Mapping[str, np.ndarray]) -> Bundle:
    stored, dtypes, shapes = {}, {}, {}
    for name, value in arrays.items():
        array = np.asarray(value)
        dtype = array.dtype.name
        if dtype in _VIEW_AS:
            array = array.view(_VIEW_AS[dtype])
        elif dtype not in _NATIVE:
            raise TypeError(f"array {name!r} has unsupported dtype {dtype}")
        # ascontiguousarray turns a 0-d array (an optimizer's step count) into shape (1,).
        stored[name] = np.ascontiguousarray(array).reshape(array.shape)
        dtypes[name] = dtype
        shapes[name] = list(array.shape)
    buffer = io.BytesIO()
    np.savez(buffer, **stored)
    data = buffer.getvalue()
    return Bundle(data, sha256(data), dtypes, shapes)


def decode_bundle(data: bytes, *, expected_sha256: str, expected_size: int,
                  dtypes: Mapping[str, str], shapes: Mapping[str, list[int]]
                  ) -> dict[str, np.ndarray]:
    """Verify, then parse without ever unpickling; every array must match the manifest."""
    if len(data) != expected_size:
        raise BadBundle(f"size {len(data)} != manifest size {expected_size} (truncated?)")
    if sha256(data) != expected_sha256:
        raise BadBundle("checksum mismatch: the object is not what the manifest committed")
    raw = _read_members(data, dtypes, shapes)
    if set(raw) != set(dtypes):
        raise BadBundle(f"arrays {sorted(raw)} do not match the manifest's {sorted(dtypes)}")
    arrays = {}
    for name, value in raw.items():
        dtype = dtypes[name]
        if dtype in _VIEW_AS:
            if value.dtype != _VIEW_AS[dtype]:
                raise BadBundle(f"array {name!r} stored as {value.dtype}, expected raw {dtype}")
            value = value.view(getattr(ml_dtypes, dtype))
        elif value.dtype.name != dtype:
            raise BadBundle(f"array {name!r} is {value.dtype}, manifest says {dtype}")
        if list(value.shape) != list(shapes[name]):
            raise BadBundle(f"array {name!r} has shape {list(value.shape)}, "
                            f"manifest says {shapes[name]}")
        arrays[name] = value
    return arrays


HEADER_SLACK = 4096     # an .npy member's header, beyond its array's bytes


def _declared_bytes(dtypes: Mapping[str, str], shapes: Mapping[str, list[int]]
                    ) -> dict[str, int]:
    out = {}
    for name, dtype in dtypes.items():
        shape = shapes.get(name) if isinstance(shapes, Mapping) else None
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise BadBundle(f"array {name!r}: bad shape {str(shape)[:80]}")
        view = _VIEW_AS.get(dtype) or (dtype if dtype in _NATIVE else None)
        if view is None:
            raise BadBundle(f"array {name!r}: unsupported dtype {str(dtype)[:40]}")
        out[name] = np.dtype(view).itemsize * math.prod(shape)
    return out


# An .npy header exactly as `np.savez` writes it for a C-ordered array of a plain dtype. Parsed
# here, not by numpy's reader: that one evaluates the header with `ast.literal_eval`, which on
# CPython 3.11 fails at random with "SystemError: AST constructor recursion depth mismatch"
# when threads parse at once (python/cpython#106905), and the syncer reads a round's offers on
# several threads: an honest learner's offer was refused as unreadable in a long haul.
_NPY_HEADER = re.compile(r"\{'descr': '([<>|=][a-z]\d{1,2})', 'fortran_order': (False|True), "
                         r"'shape': \(((?:\d{1,19}, )*\d{0,19},?)\), \} *\n")
_NPY_MAGIC = b"\x93NUMPY"


def _read_members(data: bytes, dtypes: Mapping[str, str], shapes: Mapping[str, list[int]]
                  ) -> dict[str, np.ndarray]:
    """The arrays of a bundle, read member by member. What parsing may allocate is bounded by
    what the object holds, before anything is read: the manifest's arrays must fit in the
    object (np.savez stores them uncompressed), each member may inflate to no more than its
    array, and each .npy header must declare the manifest's shape (a 260-byte header can
    declare 10^13 elements; a 379 KiB deflated member can inflate to GiB). Only plain dtypes,
    never objects: nothing is unpickled."""
    if not isinstance(dtypes, Mapping) or not isinstance(shapes, Mapping):
        raise BadBundle("the manifest's dtypes and shapes must be objects")
    declared = _declared_bytes(dtypes, shapes)
    if sum(declared.values()) > len(data):
        raise BadBundle(f"the manifest declares {sum(declared.values())} array bytes in a "
                        f"{len(data)}-byte object")
    arrays = {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                name = info.filename[:-4] if info.filename.endswith(".npy") else None
                if name not in declared or name in arrays:
                    raise BadBundle(f"unexpected member {info.filename[:80]!r}")
                if info.file_size > declared[name] + HEADER_SLACK:
                    raise BadBundle(f"member {name!r} inflates to {info.file_size} bytes, its "
                                    f"array has {declared[name]}")
                with archive.open(info) as member:
                    arrays[name] = _read_npy(member, name, shapes[name])
    except (ValueError, OSError, zipfile.BadZipFile, EOFError, NotImplementedError,
            TypeError) as err:
        if isinstance(err, BadBundle):
            raise
        raise BadBundle(f"not a plain array bundle: {str(err)[:200]}") from None
    return arrays


def _read_npy(member, name: str, shape: list[int]) -> np.ndarray:
    magic = member.read(8)
    if len(magic) != 8 or magic[:6] != _NPY_MAGIC or magic[6] not in (1, 2, 3):
        raise BadBundle(f"not a plain array bundle: member {name!r} is not an .npy array")
    width = 2 if magic[6] == 1 else 4
    length = int.from_bytes(member.read(width), "little")
    if length > HEADER_SLACK:
        raise BadBundle(f"not a plain array bundle: member {name!r} has a {length}-byte header")
    header = member.read(length).decode("utf8" if magic[6] == 3 else "latin1")
    match = _NPY_HEADER.fullmatch(header)
    if match is None:
        raise BadBundle(f"not a plain array bundle: member {name!r} header "
                        f"{header[:120]!r} is not a plain array's")
    descr, fortran, dims = match.groups()
    declared = [int(d) for d in dims.replace(",", " ").split()]
    if declared != list(shape):
        raise BadBundle(f"member {name!r} declares shape {declared[:8]}, the "
                        f"manifest {list(shape)[:8]}")
    dtype = np.dtype(descr)
    if fortran == "True" or dtype.hasobject or dtype.itemsize == 0:
        raise BadBundle(f"not a plain array bundle: member {name!r} is {descr}, "
                        f"fortran_order {fortran}")
    array = np.empty(declared, dtype)
    view = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
    got = member.readinto(view) if array.size else 0
    if got != array.nbytes or member.read(1):
        raise BadBundle(f"not a plain array bundle: member {name!r} holds other than its "
                        f"{array.nbytes} array bytes")
    return array


