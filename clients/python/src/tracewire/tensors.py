"""tracewire.v1.Tensor <-> numpy (bfloat16 / float16 widened to float32), and the SDK's
one table of the wire's dtypes (tests/test_dtype_parity.py holds it to the server's and
the TypeScript client's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .v1 import tensor_pb2


@dataclass(frozen=True)
class WireDtype:
    """A tracewire.v1.Dtype: its enum value, the name the server gives it, and how its
    little-endian bytes read in numpy (bfloat16, which numpy lacks: its raw uint16 pattern)."""

    value: tensor_pb2.Dtype
    name: str
    numpy: np.dtype[Any]

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


DTYPES: dict[int, WireDtype] = {
    d.value: d
    for d in (
        WireDtype(tensor_pb2.DTYPE_FLOAT32, "float32", np.dtype("<f4")),
        WireDtype(tensor_pb2.DTYPE_FLOAT16, "float16", np.dtype("<f2")),
        WireDtype(tensor_pb2.DTYPE_BFLOAT16, "bfloat16", np.dtype("<u2")),
        WireDtype(tensor_pb2.DTYPE_FLOAT64, "float64", np.dtype("<f8")),
        WireDtype(tensor_pb2.DTYPE_INT32, "int32", np.dtype("<i4")),
        WireDtype(tensor_pb2.DTYPE_INT64, "int64", np.dtype("<i8")),
        WireDtype(tensor_pb2.DTYPE_BOOL, "bool", np.dtype("?")),
    )
}

#: The dtype the SDK sends tensors in (writes' vectors and rows; the server computes them
#: in float32).
DEFAULT_DTYPE = DTYPES[tensor_pb2.DTYPE_FLOAT32]


def to_numpy(tensor: tensor_pb2.Tensor) -> np.ndarray[Any, Any]:
    """A read-only view for float32 / ints; a widened float32 copy for 16-bit floats."""
    array = np.frombuffer(tensor.data, dtype=DTYPES[tensor.dtype].numpy).reshape(tuple(tensor.shape))
    if tensor.dtype == tensor_pb2.DTYPE_BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    if tensor.dtype == tensor_pb2.DTYPE_FLOAT16:
        return array.astype(np.float32)
    return array


def from_numpy(values: Any) -> tensor_pb2.Tensor:
    """A DEFAULT_DTYPE (float32) tensor from anything array-like."""
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().float().numpy()
    array = np.ascontiguousarray(np.asarray(values, dtype=DEFAULT_DTYPE.numpy))
    return tensor_pb2.Tensor(dtype=DEFAULT_DTYPE.value, shape=list(array.shape), data=array.tobytes())
