"""RawTensor: the raw form values travel in between the worker and the server.

Tensors are little-endian, row-major raw bytes; bfloat16 has no numpy dtype, so it
travels as its raw uint16 pattern and is widened only where computed on. The
protobuf side (tracewire.v1.Tensor in requests and responses) is frontend/tensors.py:
the worker never sees a protobuf.
"""

from __future__ import annotations

import sys
from typing import cast

import msgspec
import numpy as np

# The dtypes a RawTensor names (numpy has no bfloat16: such values travel as raw
# uint16 patterns, named "bfloat16" only by the protobuf side).
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "bool")
_NAME_OF = {np.dtype(name): name for name in DTYPE_NAMES if name != "bfloat16"}


class RawTensor(msgspec.Struct, array_like=True, frozen=True):
    """A tensor as it crosses process boundaries: dtype name, shape, raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> RawTensor:
        if _big_endian(array):
            array = array.astype(array.dtype.newbyteorder("<"))
        # tobytes() is C order whatever the layout; 0-d arrays keep shape ().
        return cls(_name(array), tuple(int(d) for d in array.shape), array.tobytes(order="C"))

    @classmethod
    def rows_of(cls, array: np.ndarray, rows: list[int]) -> RawTensor:
        """`array[rows]`, cut from its bytes. numpy's fancy indexing lets go of the GIL
        above a few hundred elements, and the worker's collector thread, which sends
        these, waits to get the GIL back from the engine's busy thread each time."""
        if _big_endian(array) or not array.flags.c_contiguous or array.ndim == 0 or not array.shape[0]:
            return cls.from_numpy(array[rows])
        flat = memoryview(array).cast("B")
        size = array.nbytes // array.shape[0]
        if rows and rows[-1] - rows[0] + 1 == len(rows) and rows == list(range(rows[0], rows[0] + len(rows))):
            # One slice (a frontend's rows of a column laid out frontend by frontend): a
            # view, copied once by the encoder, not cut and then copied again. It keeps
            # `array` alive; it is only ever encoded, never stored.
            data = cast(bytes, flat[rows[0] * size:(rows[-1] + 1) * size])
        else:
            data = b"".join([flat[r * size:(r + 1) * size] for r in rows])
        return cls(_name(array), (len(rows), *(int(d) for d in array.shape[1:])), data)


def _big_endian(array: np.ndarray) -> bool:
    return array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big")


def _name(array: np.ndarray) -> str:
    name = _NAME_OF.get(array.dtype.newbyteorder("=") if array.dtype.byteorder == "<" else array.dtype)
    if name is None:  # numpy's dtype.name is slow; this runs per value per step
        raise TypeError(f"cannot send dtype {array.dtype}")
    return name
