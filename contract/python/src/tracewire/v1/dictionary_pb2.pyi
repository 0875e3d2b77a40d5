from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DictionaryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DICTIONARY_KIND_UNSPECIFIED: _ClassVar[DictionaryKind]
    DICTIONARY_KIND_PROBE: _ClassVar[DictionaryKind]
    DICTIONARY_KIND_SAE: _ClassVar[DictionaryKind]

class ProbeActivation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_ACTIVATION_UNSPECIFIED: _ClassVar[ProbeActivation]
    PROBE_ACTIVATION_SIGMOID: _ClassVar[ProbeActivation]
    PROBE_ACTIVATION_SOFTMAX: _ClassVar[ProbeActivation]

class SaeActivation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAE_ACTIVATION_UNSPECIFIED: _ClassVar[SaeActivation]
    SAE_ACTIVATION_RELU: _ClassVar[SaeActivation]
    SAE_ACTIVATION_JUMPRELU: _ClassVar[SaeActivation]
    SAE_ACTIVATION_TOPK: _ClassVar[SaeActivation]
DICTIONARY_KIND_UNSPECIFIED: DictionaryKind
DICTIONARY_KIND_PROBE: DictionaryKind
DICTIONARY_KIND_SAE: DictionaryKind
PROBE_ACTIVATION_UNSPECIFIED: ProbeActivation
PROBE_ACTIVATION_SIGMOID: ProbeActivation
PROBE_ACTIVATION_SOFTMAX: ProbeActivation
SAE_ACTIVATION_UNSPECIFIED: SaeActivation
SAE_ACTIVATION_RELU: SaeActivation
SAE_ACTIVATION_JUMPRELU: SaeActivation
SAE_ACTIVATION_TOPK: SaeActivation

class DictionarySpec(_message.Message):
    __slots__ = ("kind", "module", "probe_activation", "sae_activation", "sae_top_k", "subtract_decoder_bias", "labels", "description")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    PROBE_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    SAE_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    SAE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    SUBTRACT_DECODER_BIAS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    kind: DictionaryKind
    module: str
    probe_activation: ProbeActivation
    sae_activation: SaeActivation
    sae_top_k: int
    subtract_decoder_bias: bool
    labels: _containers.RepeatedScalarFieldContainer[str]
    description: str
    def __init__(self, kind: _Optional[_Union[DictionaryKind, str]] = ..., module: _Optional[str] = ..., probe_activation: _Optional[_Union[ProbeActivation, str]] = ..., sae_activation: _Optional[_Union[SaeActivation, str]] = ..., sae_top_k: _Optional[int] = ..., subtract_decoder_bias: _Optional[bool] = ..., labels: _Optional[_Iterable[str]] = ..., description: _Optional[str] = ...) -> None: ...

class Dictionary(_message.Message):
    __slots__ = ("name", "spec", "input_size", "size", "dtype", "device_bytes", "owner", "generation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INPUT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: DictionarySpec
    input_size: int
    size: int
    dtype: str
    device_bytes: int
    owner: str
    generation: int
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[DictionarySpec, _Mapping]] = ..., input_size: _Optional[int] = ..., size: _Optional[int] = ..., dtype: _Optional[str] = ..., device_bytes: _Optional[int] = ..., owner: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class RegisterDictionaryRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: DictionaryHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[DictionaryHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class RegisterDictionaryResponse(_message.Message):
    __slots__ = ("dictionary",)
    DICTIONARY_FIELD_NUMBER: _ClassVar[int]
    dictionary: Dictionary
    def __init__(self, dictionary: _Optional[_Union[Dictionary, _Mapping]] = ...) -> None: ...

class DictionaryHeader(_message.Message):
    __slots__ = ("name", "spec", "replace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: DictionarySpec
    replace: bool
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[DictionarySpec, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class ListDictionariesRequest(_message.Message):
    __slots__ = ("omit_labels",)
    OMIT_LABELS_FIELD_NUMBER: _ClassVar[int]
    omit_labels: bool
    def __init__(self, omit_labels: _Optional[bool] = ...) -> None: ...

class ListDictionariesResponse(_message.Message):
    __slots__ = ("dictionaries",)
    DICTIONARIES_FIELD_NUMBER: _ClassVar[int]
    dictionaries: _containers.RepeatedCompositeFieldContainer[Dictionary]
    def __init__(self, dictionaries: _Optional[_Iterable[_Union[Dictionary, _Mapping]]] = ...) -> None: ...

class DeleteDictionaryRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteDictionaryResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...
