"""tracewire.v1.Tensor <-> numpy, and the raw form values travel in inside the server.

Tensors are little-endian, row-major raw bytes; bfloat16 has no numpy dtype,
so it travels as its raw uint16 pattern and is widened only where computed on.
"""

from __future__ import annotations

import math
import sys

import msgspec
import numpy as np
from tracewire.v1 import tensor_pb2

from ..frontend.errors import InvalidArgument

_NUMPY: dict[int, np.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    tensor_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),  # raw bit pattern
    tensor_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
    tensor_pb2.DTYPE_BOOL: np.dtype("?"),
}
_DTYPE_NAMES = {
    "float32": tensor_pb2.DTYPE_FLOAT32,
    "float16": tensor_pb2.DTYPE_FLOAT16,
    "bfloat16": tensor_pb2.DTYPE_BFLOAT16,
    "float64": tensor_pb2.DTYPE_FLOAT64,
    "int32": tensor_pb2.DTYPE_INT32,
    "int64": tensor_pb2.DTYPE_INT64,
    "bool": tensor_pb2.DTYPE_BOOL,
}


# numpy has no bfloat16: such values are widened or sent as raw uint16 patterns.
_NAME_OF = {np.dtype(name): name for name in _DTYPE_NAMES if name != "bfloat16"}


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
        data = b"".join([flat[r * size:(r + 1) * size] for r in rows])
        return cls(_name(array), (len(rows), *(int(d) for d in array.shape[1:])), data)

    def fill(self, message: tensor_pb2.Tensor) -> None:
        """Write this tensor into a (sub)message in place."""
        message.dtype = _DTYPE_NAMES[self.dtype]
        message.shape.extend(self.shape)
        message.data = self.data


def _big_endian(array: np.ndarray) -> bool:
    return array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big")


def _name(array: np.ndarray) -> str:
    name = _NAME_OF.get(array.dtype.newbyteorder("=") if array.dtype.byteorder == "<" else array.dtype)
    if name is None:  # numpy's dtype.name is slow; this runs per value per step
        raise TypeError(f"cannot send dtype {array.dtype}")
    return name


# Request tensors: numpy handles at most 64 dimensions; no request needs more than a few.
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 31


def float_vector(tensor: tensor_pb2.Tensor, length: int, field: str) -> np.ndarray:
    """A finite float32 vector of exactly `length` elements from a request tensor."""
    if list(tensor.shape) != [length]:  # before any work sized by the request's shape
        shape = list(tensor.shape[:MAX_DIMS]) + (["..."] if len(tensor.shape) > MAX_DIMS else [])
        raise InvalidArgument(f"{field}.shape", f"expected a vector of {length} elements, got shape {shape}")
    array = to_numpy(tensor, field).astype(np.float32).reshape(-1)
    if not np.isfinite(array).all():
        raise InvalidArgument(f"{field}.data", "must not contain NaN or infinity")
    return array


def to_numpy(tensor: tensor_pb2.Tensor, field: str) -> np.ndarray:
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise InvalidArgument(f"{field}.dtype", "dtype must be set")
    if len(tensor.shape) > MAX_DIMS:
        raise InvalidArgument(f"{field}.shape", f"{len(tensor.shape)} dimensions; at most {MAX_DIMS}")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape", "dimensions must be >= 0")
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:  # numpy refuses such shapes even empty
        raise InvalidArgument(f"{field}.shape", f"{list(shape)} is over {MAX_ELEMENTS} elements")
    count = math.prod(shape)
    if len(tensor.data) != count * dtype.itemsize:
        raise InvalidArgument(
            f"{field}.data",
            f"has {len(tensor.data)} bytes; shape {list(shape)} of {dtype.name} needs "
            f"{count * dtype.itemsize}",
        )
    array = np.frombuffer(tensor.data, dtype=dtype).reshape(shape)
    if tensor.dtype == tensor_pb2.DTYPE_BFLOAT16:
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array
