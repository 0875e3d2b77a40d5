"""Dictionaries (linear probes, sparse autoencoders) on the server: what the registry calls
send and return.

`register_dictionary` takes the spec as a mapping ({"kind": "probe", "module":
"layers.2", ...}, the DictionarySpec's fields with short names for the enums), a
DictionarySpec, or the path of a NAME.json (the server's --dictionaries format); and the
weights as a mapping of arrays (numpy or torch: "W", "b" for a probe; "W_enc", "b_enc",
"W_dec", "b_dec", "threshold" for an SAE), safetensors bytes, or the path of a
.safetensors file. Arrays are written as safetensors here (float64 ones as float32), so
neither numpy, torch nor safetensors is needed for the rest of the SDK.

Reading and writing a dictionary inside a trace (probe / features reads, steer / clamp /
ablate writes) is dictionary_ops.py.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from google.protobuf import json_format

from .errors import InvalidArgument
from .v1 import dictionary_pb2

# Chunks of the uploaded file: well under any server's --max-request-bytes (8 MiB by default).
CHUNK_BYTES = 1 << 20

DictionaryKind = Literal["probe", "sae"]

_KINDS: dict[str, Any] = {"probe": dictionary_pb2.DICTIONARY_KIND_PROBE, "sae": dictionary_pb2.DICTIONARY_KIND_SAE}
_PROBE_ACTIVATIONS: dict[str, Any] = {
    "none": dictionary_pb2.PROBE_ACTIVATION_UNSPECIFIED,
    "sigmoid": dictionary_pb2.PROBE_ACTIVATION_SIGMOID,
    "softmax": dictionary_pb2.PROBE_ACTIVATION_SOFTMAX,
}
_SAE_ACTIVATIONS: dict[str, Any] = {
    "relu": dictionary_pb2.SAE_ACTIVATION_RELU,
    "jumprelu": dictionary_pb2.SAE_ACTIVATION_JUMPRELU,
    "topk": dictionary_pb2.SAE_ACTIVATION_TOPK,
}
_SHORT_ENUMS = {"kind": _KINDS, "probe_activation": _PROBE_ACTIVATIONS, "sae_activation": _SAE_ACTIVATIONS}


@dataclass(frozen=True)
class Dictionary:
    """A dictionary the server holds (ListDictionaries, RegisterDictionary)."""

    name: str
    kind: DictionaryKind
    module: str  # the module whose output it reads and writes
    input_size: int  # the model's hidden size
    size: int  # probe outputs (k) or SAE features (d)
    dtype: str  # of its weights on the device
    device_bytes: int
    owner: str  # "" for the operator's (--dictionaries); else the registering client's tenant
    generation: int  # changes each time the name is registered
    labels: tuple[str, ...] = ()
    description: str = ""
    probe_activation: str = "none"  # probes: "none", "sigmoid" or "softmax"
    sae_activation: str = ""  # SAEs: "relu", "jumprelu" or "topk"
    sae_top_k: int = 0
    subtract_decoder_bias: bool = False


def dictionary(message: dictionary_pb2.Dictionary) -> Dictionary:
    spec = message.spec
    kind: DictionaryKind = "sae" if spec.kind == dictionary_pb2.DICTIONARY_KIND_SAE else "probe"
    return Dictionary(
        name=message.name,
        kind=kind,
        module=spec.module,
        input_size=message.input_size,
        size=message.size,
        dtype=message.dtype,
        device_bytes=message.device_bytes,
        owner=message.owner,
        generation=message.generation,
        labels=tuple(spec.labels),
        description=spec.description,
        probe_activation=_name(_PROBE_ACTIVATIONS, spec.probe_activation) if kind == "probe" else "",
        sae_activation=(_name(_SAE_ACTIVATIONS, spec.sae_activation) or "relu") if kind == "sae" else "",
        sae_top_k=spec.sae_top_k,
        subtract_decoder_bias=spec.subtract_decoder_bias,
    )


def _name(names: Mapping[str, Any], value: int) -> str:
    return next((k for k, v in names.items() if v == value), "")


SpecLike = Mapping[str, Any] | dictionary_pb2.DictionarySpec | str | os.PathLike[str]
TensorsLike = Mapping[str, Any] | bytes | str | os.PathLike[str]


def to_spec(spec: SpecLike) -> dictionary_pb2.DictionarySpec:
    """A DictionarySpec from a mapping, a message, or a NAME.json path."""
    if isinstance(spec, dictionary_pb2.DictionarySpec):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        text = Path(spec).read_text()
        try:
            return json_format.Parse(text, dictionary_pb2.DictionarySpec())
        except json_format.ParseError as e:
            raise InvalidArgument(f"{spec}: not a DictionarySpec in protobuf JSON: {e}", field="spec") from None
    fields = dict(spec)
    for key, names in _SHORT_ENUMS.items():
        value = fields.get(key)
        if isinstance(value, str) and value in names:
            fields[key] = names[value]
    try:
        return dictionary_pb2.DictionarySpec(**fields)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"spec: {e}", field="spec") from None


def header_request(name: str, spec: SpecLike, replace: bool) -> dictionary_pb2.RegisterDictionaryRequest:
    header = dictionary_pb2.DictionaryHeader(name=name, spec=to_spec(spec), replace=replace)
    return dictionary_pb2.RegisterDictionaryRequest(header=header)


def chunks(tensors: TensorsLike, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The safetensors file's bytes, in chunks; a file is read as the upload goes."""
    if isinstance(tensors, (str, os.PathLike)):
        with open(tensors, "rb") as f:
            while chunk := f.read(chunk_bytes):
                yield chunk
        return
    data = tensors if isinstance(tensors, bytes) else safetensors_bytes(tensors)
    for start in range(0, len(data), chunk_bytes):
        yield data[start : start + chunk_bytes]


def safetensors_bytes(tensors: Mapping[str, Any]) -> bytes:
    """`tensors` (numpy arrays, torch tensors, nested lists) as a safetensors file."""
    header: dict[str, Any] = {}
    parts: list[bytes] = []
    offset = 0
    for name, value in tensors.items():
        dtype, shape, data = _raw(value)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        parts.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # (safetensors aligns the data to 8 bytes)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(parts)


def _raw(value: Any) -> tuple[str, list[int], bytes]:
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().contiguous()
        if str(value.dtype) == "torch.bfloat16":
            # numpy has no bfloat16: its bits as int16
            return "BF16", list(value.shape), value.view(_torch_int16(value)).numpy().astype("<i2").tobytes()
        value = value.numpy()
    import numpy as np

    array = np.asarray(value)
    if array.dtype == np.float16:
        return "F16", list(array.shape), array.astype("<f2").tobytes()
    if array.dtype.kind in "fiu":  # float64 (numpy's default) and ints: float32
        return "F32", list(array.shape), np.ascontiguousarray(array, dtype="<f4").tobytes()
    raise InvalidArgument(f"tensor dtype {array.dtype}: give float32, float16 or bfloat16 values", field="tensors")


def _torch_int16(value: Any) -> Any:
    import torch

    return torch.int16
