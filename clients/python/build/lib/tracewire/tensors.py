"""tracewire.v1.Tensor <-> numpy (bfloat16 / float16 widened to float32)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .v1 import tensor_pb2

_DTYPES: dict[int, str] = {
    tensor_pb2.DTYPE_FLOAT32: "<f4",
    tensor_pb2.DTYPE_FLOAT16: "<f2",
    tensor_pb2.DTYPE_BFLOAT16: "<u2",
    tensor_pb2.DTYPE_FLOAT64: "<f8",
    tensor_pb2.DTYPE_INT32: "<i4",
    tensor_pb2.DTYPE_INT64: "<i8",
    tensor_pb2.DTYPE_BOOL: "?",
}


def to_numpy(tensor: tensor_pb2.Tensor) -> np.ndarray[Any, Any]:
    """A read-only view for float32 / ints; a widened float32 copy for 16-bit floats."""
    dtype = _DTYPES[tensor.dtype]
    array = np.frombuffer(tensor.data, dtype=dtype).reshape(tuple(tensor.shape))
    if tensor.dtype == tensor_pb2.DTYPE_BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    if tensor.dtype == tensor_pb2.DTYPE_FLOAT16:
        return array.astype(np.float32)
    return array


def from_numpy(values: Any) -> tensor_pb2.Tensor:
    """A float32 tensor (the dtype writes take) from anything array-like."""
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().float().numpy()
    array = np.ascontiguousarray(np.asarray(values, dtype="<f4"))
    return tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(array.shape), data=array.tobytes()
    )
