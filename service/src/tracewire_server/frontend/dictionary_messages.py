"""Dictionaries at the edge: dictionary.proto's DictionarySpec -> DictionaryInfo (checked
field by field) and DictionaryInfo -> the Dictionary message."""

from __future__ import annotations

from typing import Any

import msgspec
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tracewire.v1 import dictionary_pb2, intervention_pb2

from ..shared.dictionary_spec import (
    DictionaryError,
    DictionaryInfo,
    DictionaryKind,
    ProbeActivation,
    SaeActivation,
    check_name,
)

_KINDS: dict[int, DictionaryKind] = {
    dictionary_pb2.DICTIONARY_KIND_PROBE: "probe",
    dictionary_pb2.DICTIONARY_KIND_SAE: "sae",
}
_PROBE_ACTIVATIONS: dict[int, ProbeActivation] = {
    dictionary_pb2.PROBE_ACTIVATION_UNSPECIFIED: "none",
    dictionary_pb2.PROBE_ACTIVATION_SIGMOID: "sigmoid",
    dictionary_pb2.PROBE_ACTIVATION_SOFTMAX: "softmax",
}
_SAE_ACTIVATIONS: dict[int, SaeActivation] = {
    dictionary_pb2.SAE_ACTIVATION_UNSPECIFIED: "relu",
    dictionary_pb2.SAE_ACTIVATION_RELU: "relu",
    dictionary_pb2.SAE_ACTIVATION_JUMPRELU: "jumprelu",
    dictionary_pb2.SAE_ACTIVATION_TOPK: "topk",
}
# (typed Any: the generated enums' value types are not ints to mypy)
_KIND_VALUES: dict[str, Any] = {v: k for k, v in _KINDS.items()}
_PROBE_VALUES: dict[str, Any] = {v: k for k, v in _PROBE_ACTIVATIONS.items()}
_SAE_VALUES: dict[str, Any] = {
    "relu": dictionary_pb2.SAE_ACTIVATION_RELU,
    "jumprelu": dictionary_pb2.SAE_ACTIVATION_JUMPRELU,
    "topk": dictionary_pb2.SAE_ACTIVATION_TOPK,
}


def info_from_spec(name: str, spec: dictionary_pb2.DictionarySpec) -> DictionaryInfo:
    """What the spec says, sizes not yet known (check_tensors fills them in from the file).
    DictionaryError names the field ("name", "spec.kind", ...) relative to the header."""
    check_name(name, "name")
    kind = _KINDS.get(spec.kind)
    if kind is None:
        raise DictionaryError("spec.kind", "DICTIONARY_KIND_PROBE or DICTIONARY_KIND_SAE is required")
    probe_activation = _PROBE_ACTIVATIONS.get(spec.probe_activation)
    if probe_activation is None:
        raise DictionaryError("spec.probe_activation", f"unknown value {spec.probe_activation}")
    sae_activation = _SAE_ACTIVATIONS.get(spec.sae_activation)
    if sae_activation is None:
        raise DictionaryError("spec.sae_activation", f"unknown value {spec.sae_activation}")
    if kind == "probe" and spec.sae_activation:
        raise DictionaryError("spec.sae_activation", "is for SAEs; this is a probe")
    if kind == "sae" and spec.probe_activation:
        raise DictionaryError("spec.probe_activation", "is for probes; this is an SAE")
    if spec.sae_top_k and sae_activation != "topk":
        raise DictionaryError("spec.sae_top_k", "only SAE_ACTIVATION_TOPK takes a top_k")
    return DictionaryInfo(
        name=name,
        kind=kind,
        module=spec.module,
        input_size=0,
        size=0,
        dtype="",
        device_bytes=0,
        probe_activation=probe_activation,
        sae_activation=sae_activation,
        sae_top_k=spec.sae_top_k,
        subtract_decoder_bias=spec.subtract_decoder_bias,
        labels=tuple(spec.labels),
        description=spec.description,
    )


def with_owner(info: DictionaryInfo, owner: str, generation: int) -> DictionaryInfo:
    return msgspec.structs.replace(info, owner=owner, generation=generation)


def to_message(info: DictionaryInfo, omit_labels: bool = False) -> dictionary_pb2.Dictionary:
    spec = dictionary_pb2.DictionarySpec(
        kind=_KIND_VALUES[info.kind],
        module=info.module,
        subtract_decoder_bias=info.subtract_decoder_bias,
        labels=() if omit_labels else info.labels,
        description=info.description,
    )
    if info.kind == "probe":
        spec.probe_activation = _PROBE_VALUES[info.probe_activation]
    else:
        spec.sae_activation = _SAE_VALUES[info.sae_activation]
        spec.sae_top_k = info.sae_top_k
    return dictionary_pb2.Dictionary(
        name=info.name,
        spec=spec,
        input_size=info.input_size,
        size=info.size,
        dtype=info.dtype,
        device_bytes=info.device_bytes,
        owner=info.owner,
        generation=info.generation,
    )


_NAMING = frozenset({
    intervention_pb2.ReadDictionary.DESCRIPTOR.full_name,
    intervention_pb2.WriteDictionary.DESCRIPTOR.full_name,
    intervention_pb2.DictionaryThreshold.DESCRIPTOR.full_name,
})


def dictionary_names(message: Message) -> set[str]:
    """Every dictionary a request names (reads, writes, conditions), for a shared
    frontend to fetch before it compiles. Walks only the fields set."""
    names: set[str] = set()
    _collect(message, names)
    return names


def _collect(message: Message, names: set[str]) -> None:
    if message.DESCRIPTOR.full_name in _NAMING:
        names.add(message.dictionary)  # type: ignore[attr-defined]
        return
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.is_repeated:
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                continue
            for item in value:
                _collect(item, names)
        else:
            _collect(value, names)
