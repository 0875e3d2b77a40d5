"""Dictionaries (linear probes, sparse autoencoders): what one is, checked against the model.

A dictionary is a safetensors file of weights plus a spec (the manifest: dictionary.proto's
DictionarySpec). `check_tensors` decides from the file's tensor names, dtypes and shapes
alone whether it is a well-formed dictionary for this model, and `DictionaryInfo` is
what the server knows of one it holds: the frontend's registry and compiler use it, the
worker keeps it beside the weights. Shared by both so a file is judged by one set of
rules wherever it is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Literal

import msgspec

from .plan import unit_kind

DictionaryKind = Literal["probe", "sae"]
ProbeActivation = Literal["none", "sigmoid", "softmax"]
SaeActivation = Literal["relu", "jumprelu", "topk"]

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_LABEL_CHARS = 256
MAX_DESCRIPTION_CHARS = 1024
DTYPES = ("float32", "float16", "bfloat16")
# safetensors' dtype names -> ours
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class DictionaryError(ValueError):
    """A dictionary that cannot be served: `field` names the spec field or tensor at fault
    (the frontend turns it into INVALID_ARGUMENT naming it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class DictionaryInfo(msgspec.Struct, frozen=True):
    """A dictionary the server holds, as requests are checked against it."""

    name: str
    kind: DictionaryKind
    module: str  # the module whose output it reads and writes
    input_size: int  # the model's hidden size
    size: int  # probe outputs (k) or SAE features (d)
    dtype: str  # of the weights on the device
    device_bytes: int
    probe_activation: ProbeActivation = "none"
    sae_activation: SaeActivation = "relu"
    sae_top_k: int = 0
    subtract_decoder_bias: bool = False
    labels: tuple[str, ...] = ()
    description: str = ""
    owner: str = ""  # "" : the operator's (--dictionaries)
    generation: int = 0  # changes each time the name is registered


def check_name(name: str, field: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise DictionaryError(field, f"{name!r} is not a dictionary name: 1-64 characters of [A-Za-z0-9._-]")


# Tensors each kind takes: name -> (required, shape as a function of (hidden, size)).
_Shape = Callable[[int, int], tuple[int, ...]]
_TENSORS: dict[DictionaryKind, dict[str, tuple[bool, _Shape]]] = {
    "probe": {
        "W": (True, lambda h, n: (n, h)),
        "b": (False, lambda h, n: (n,)),
    },
    "sae": {
        "W_enc": (True, lambda h, n: (h, n)),
        "b_enc": (False, lambda h, n: (n,)),
        "W_dec": (True, lambda h, n: (n, h)),
        "b_dec": (False, lambda h, n: (h,)),
        "threshold": (False, lambda h, n: (n,)),
    },
}


def check_tensors(
    info: DictionaryInfo, tensors: Mapping[str, tuple[str, tuple[int, ...]]], hidden_size: int
) -> DictionaryInfo:
    """`info` (from the spec, size and dtype not yet known) completed from the file's
    tensors (name -> (dtype, shape), dtypes as in DTYPES), or DictionaryError naming the
    tensor or spec field at fault."""
    wanted = _TENSORS[info.kind]
    for name in tensors:
        if name not in wanted:
            raise DictionaryError(f"tensors.{name}", f"a {info.kind} takes the tensors {', '.join(wanted)}, "
                                  f"not {name!r}")
    main = "W" if info.kind == "probe" else "W_dec"
    if main not in tensors:
        raise DictionaryError(f"tensors.{main}", f"missing: a {info.kind} needs {main}")
    shape = tensors[main][1]
    if len(shape) != 2 or shape[1] != hidden_size:
        rows = "k" if info.kind == "probe" else "d"
        raise DictionaryError(f"tensors.{main}", f"shape {list(shape)}: expected [{rows}, {hidden_size}] (the "
                              f"model's hidden size is {hidden_size})")
    size = shape[0]
    if size < 1:
        raise DictionaryError(f"tensors.{main}", "has no rows")
    dtypes = {dtype for dtype, _ in tensors.values()}
    if len(dtypes) != 1:
        raise DictionaryError("tensors", f"mixed dtypes {sorted(dtypes)}: store every tensor in one dtype")
    dtype = dtypes.pop()
    if dtype not in DTYPES:
        raise DictionaryError("tensors", f"dtype {dtype}: expected one of {', '.join(DTYPES)}")
    for name, (required, shape_of) in wanted.items():
        expected = shape_of(hidden_size, size)
        if name not in tensors:
            if required:
                raise DictionaryError(f"tensors.{name}", f"missing: a {info.kind} needs {name} {list(expected)}")
            continue
        if tensors[name][1] != expected:
            raise DictionaryError(f"tensors.{name}", f"shape {list(tensors[name][1])}: expected {list(expected)}")
    if info.kind == "sae":
        if (info.sae_activation == "jumprelu") != ("threshold" in tensors):
            raise DictionaryError("tensors.threshold", "JumpReLU SAEs need a threshold [d]; other SAEs take none")
        if info.sae_activation == "topk" and not 1 <= info.sae_top_k <= size:
            raise DictionaryError("spec.sae_top_k", f"must be in [1, {size}] (the features), got {info.sae_top_k}")
    if info.labels and len(info.labels) != size:
        raise DictionaryError("spec.labels", f"{len(info.labels)} labels for {size} "
                              f"{'outputs' if info.kind == 'probe' else 'features'}: give one each, or none")
    device_bytes = sum(_count(shape) for _, shape in tensors.values()) * (4 if dtype == "float32" else 2)
    return msgspec.structs.replace(info, input_size=hidden_size, size=size, dtype=dtype, device_bytes=device_bytes)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_spec(info: DictionaryInfo, modules: Mapping[str, int], hidden_size: int) -> None:
    """The spec's own fields: the module exists and has the hidden size's width
    (`modules`: path -> output width), labels and description within bounds."""
    if unit_kind(info.module):
        raise DictionaryError("spec.module", f"{info.module!r} is a unit-addressed module (heads / neurons); a "
                              "dictionary reads a module's output rows, e.g. a decoder layer (layers.N)")
    width = modules.get(info.module)
    if width is None:
        raise DictionaryError("spec.module", f"unknown module {info.module!r}; GetModelInfo lists them")
    if width != hidden_size:
        raise DictionaryError("spec.module", f"{info.module!r} outputs {width} values a position; a dictionary "
                              f"reads a module of the hidden size ({hidden_size})")
    for i, label in enumerate(info.labels):
        if len(label) > MAX_LABEL_CHARS:
            raise DictionaryError(f"spec.labels[{i}]", f"{len(label)} characters; at most {MAX_LABEL_CHARS}")
    if len(info.description) > MAX_DESCRIPTION_CHARS:
        raise DictionaryError("spec.description", f"{len(info.description)} characters; at most "
                              f"{MAX_DESCRIPTION_CHARS}")


_INFO_ENCODER = msgspec.msgpack.Encoder()
_INFO_DECODER = msgspec.msgpack.Decoder(DictionaryInfo)


def encode_info(info: DictionaryInfo) -> bytes:
    """For the worker RPCs (collective_rpc carries plain bytes)."""
    return _INFO_ENCODER.encode(info)


def decode_info(data: bytes) -> DictionaryInfo:
    return _INFO_DECODER.decode(data)
