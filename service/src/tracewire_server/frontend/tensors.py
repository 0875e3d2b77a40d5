"""tracewire.v1.Tensor <-> numpy and RawTensor: the protobuf edge of tensors.

Request tensors are checked here (shape, dtype, size) and raise InvalidArgument;
values read in the worker arrive as RawTensors (shared/tensors.py) and are written
into response messages here. Separate from RawTensor because the worker must not
import protobufs or the frontend's errors.
"""

from __future__ import annotations

import math

import numpy as np
from tracewire.v1 import tensor_pb2

from ..shared.tensors import RawTensor
from .errors import InvalidArgument

_NUMPY: dict[int, np.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    tensor_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),  # raw bit pattern
    tensor_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
    tensor_pb2.DTYPE_BOOL: np.dtype("?"),
}
_DTYPES = {
    "float32": tensor_pb2.DTYPE_FLOAT32,
    "float16": tensor_pb2.DTYPE_FLOAT16,
    "bfloat16": tensor_pb2.DTYPE_BFLOAT16,
    "float64": tensor_pb2.DTYPE_FLOAT64,
    "int32": tensor_pb2.DTYPE_INT32,
    "int64": tensor_pb2.DTYPE_INT64,
    "bool": tensor_pb2.DTYPE_BOOL,
}


def fill(message: tensor_pb2.Tensor, tensor: RawTensor) -> None:
    """Write `tensor` into a (sub)message in place."""
    message.dtype = _DTYPES[tensor.dtype]
    message.shape.extend(tensor.shape)
    message.data = tensor.data


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


def float_tensor(tensor: tensor_pb2.Tensor, shapes: list[tuple[int, ...]], field: str) -> np.ndarray:
    """A finite float32 tensor of one of `shapes` from a request tensor, flattened."""
    if tuple(tensor.shape) not in shapes:  # before any work sized by the request's shape
        shape = list(tensor.shape[:MAX_DIMS]) + (["..."] if len(tensor.shape) > MAX_DIMS else [])
        expected = " or ".join(str(list(s)) for s in shapes)
        raise InvalidArgument(f"{field}.shape", f"expected shape {expected}, got {shape}")
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
