from tracewire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogitsStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGITS_STAGE_UNSPECIFIED: _ClassVar[LogitsStage]
    LOGITS_STAGE_RAW: _ClassVar[LogitsStage]
    LOGITS_STAGE_PROCESSED: _ClassVar[LogitsStage]
    LOGITS_STAGE_BEFORE_WRITES: _ClassVar[LogitsStage]

class Reduction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCTION_UNSPECIFIED: _ClassVar[Reduction]
    REDUCTION_MEAN: _ClassVar[Reduction]

class Comparison(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPARISON_UNSPECIFIED: _ClassVar[Comparison]
    COMPARISON_GREATER: _ClassVar[Comparison]
    COMPARISON_GREATER_EQUAL: _ClassVar[Comparison]
    COMPARISON_LESS: _ClassVar[Comparison]
    COMPARISON_LESS_EQUAL: _ClassVar[Comparison]
LOGITS_STAGE_UNSPECIFIED: LogitsStage
LOGITS_STAGE_RAW: LogitsStage
LOGITS_STAGE_PROCESSED: LogitsStage
LOGITS_STAGE_BEFORE_WRITES: LogitsStage
REDUCTION_UNSPECIFIED: Reduction
REDUCTION_MEAN: Reduction
COMPARISON_UNSPECIFIED: Comparison
COMPARISON_GREATER: Comparison
COMPARISON_GREATER_EQUAL: Comparison
COMPARISON_LESS: Comparison
COMPARISON_LESS_EQUAL: Comparison

class Intervention(_message.Message):
    __slots__ = ("name", "steps", "condition", "read_logits", "read_sample", "read_logprobs", "read_module", "read_logit_lens", "read_attention_pattern", "read_dictionary", "force_sample", "write_logits", "write_module", "write_dictionary", "stop")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    READ_LOGITS_FIELD_NUMBER: _ClassVar[int]
    READ_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    READ_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    READ_MODULE_FIELD_NUMBER: _ClassVar[int]
    READ_LOGIT_LENS_FIELD_NUMBER: _ClassVar[int]
    READ_ATTENTION_PATTERN_FIELD_NUMBER: _ClassVar[int]
    READ_DICTIONARY_FIELD_NUMBER: _ClassVar[int]
    FORCE_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    WRITE_LOGITS_FIELD_NUMBER: _ClassVar[int]
    WRITE_MODULE_FIELD_NUMBER: _ClassVar[int]
    WRITE_DICTIONARY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    name: str
    steps: StepSelector
    condition: Condition
    read_logits: ReadLogits
    read_sample: ReadSample
    read_logprobs: ReadLogprobs
    read_module: ReadModule
    read_logit_lens: ReadLogitLens
    read_attention_pattern: ReadAttentionPattern
    read_dictionary: ReadDictionary
    force_sample: ForceSample
    write_logits: WriteLogits
    write_module: WriteModule
    write_dictionary: WriteDictionary
    stop: Stop
    def __init__(self, name: _Optional[str] = ..., steps: _Optional[_Union[StepSelector, _Mapping]] = ..., condition: _Optional[_Union[Condition, _Mapping]] = ..., read_logits: _Optional[_Union[ReadLogits, _Mapping]] = ..., read_sample: _Optional[_Union[ReadSample, _Mapping]] = ..., read_logprobs: _Optional[_Union[ReadLogprobs, _Mapping]] = ..., read_module: _Optional[_Union[ReadModule, _Mapping]] = ..., read_logit_lens: _Optional[_Union[ReadLogitLens, _Mapping]] = ..., read_attention_pattern: _Optional[_Union[ReadAttentionPattern, _Mapping]] = ..., read_dictionary: _Optional[_Union[ReadDictionary, _Mapping]] = ..., force_sample: _Optional[_Union[ForceSample, _Mapping]] = ..., write_logits: _Optional[_Union[WriteLogits, _Mapping]] = ..., write_module: _Optional[_Union[WriteModule, _Mapping]] = ..., write_dictionary: _Optional[_Union[WriteDictionary, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ...) -> None: ...

class StepSelector(_message.Message):
    __slots__ = ("all", "range", "list")
    ALL_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    all: AllSteps
    range: StepRange
    list: StepList
    def __init__(self, all: _Optional[_Union[AllSteps, _Mapping]] = ..., range: _Optional[_Union[StepRange, _Mapping]] = ..., list: _Optional[_Union[StepList, _Mapping]] = ...) -> None: ...

class AllSteps(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class StepList(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenSet(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadLogits(_message.Message):
    __slots__ = ("stage", "full", "top_k", "token_ids")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    stage: LogitsStage
    full: FullRow
    top_k: TopK
    token_ids: TokenSet
    def __init__(self, stage: _Optional[_Union[LogitsStage, str]] = ..., full: _Optional[_Union[FullRow, _Mapping]] = ..., top_k: _Optional[_Union[TopK, _Mapping]] = ..., token_ids: _Optional[_Union[TokenSet, _Mapping]] = ...) -> None: ...

class FullRow(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TopK(_message.Message):
    __slots__ = ("k",)
    K_FIELD_NUMBER: _ClassVar[int]
    k: int
    def __init__(self, k: _Optional[int] = ...) -> None: ...

class ReadSample(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadLogprobs(_message.Message):
    __slots__ = ("top_k",)
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    def __init__(self, top_k: _Optional[int] = ...) -> None: ...

class Positions(_message.Message):
    __slots__ = ("new_token", "all_prompt", "prompt_range", "prompt_list", "all")
    NEW_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ALL_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RANGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LIST_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    new_token: NewToken
    all_prompt: AllPrompt
    prompt_range: PositionRange
    prompt_list: PositionList
    all: AllPositions
    def __init__(self, new_token: _Optional[_Union[NewToken, _Mapping]] = ..., all_prompt: _Optional[_Union[AllPrompt, _Mapping]] = ..., prompt_range: _Optional[_Union[PositionRange, _Mapping]] = ..., prompt_list: _Optional[_Union[PositionList, _Mapping]] = ..., all: _Optional[_Union[AllPositions, _Mapping]] = ...) -> None: ...

class NewToken(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AllPrompt(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AllPositions(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PositionRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class PositionList(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, positions: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadModule(_message.Message):
    __slots__ = ("module", "positions", "reduction", "units")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REDUCTION_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    module: str
    positions: Positions
    reduction: Reduction
    units: UnitSelection
    def __init__(self, module: _Optional[str] = ..., positions: _Optional[_Union[Positions, _Mapping]] = ..., reduction: _Optional[_Union[Reduction, str]] = ..., units: _Optional[_Union[UnitSelection, _Mapping]] = ...) -> None: ...

class UnitSelection(_message.Message):
    __slots__ = ("ids", "top_k")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ids: UnitIds
    top_k: TopK
    def __init__(self, ids: _Optional[_Union[UnitIds, _Mapping]] = ..., top_k: _Optional[_Union[TopK, _Mapping]] = ...) -> None: ...

class UnitIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadLogitLens(_message.Message):
    __slots__ = ("layers", "positions", "top_k")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    positions: Positions
    top_k: int
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., positions: _Optional[_Union[Positions, _Mapping]] = ..., top_k: _Optional[int] = ...) -> None: ...

class ReadAttentionPattern(_message.Message):
    __slots__ = ("layers", "heads", "positions", "top_k")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    heads: _containers.RepeatedScalarFieldContainer[int]
    positions: Positions
    top_k: int
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., heads: _Optional[_Iterable[int]] = ..., positions: _Optional[_Union[Positions, _Mapping]] = ..., top_k: _Optional[int] = ...) -> None: ...

class ForceSample(_message.Message):
    __slots__ = ("token_id",)
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    def __init__(self, token_id: _Optional[int] = ...) -> None: ...

class WriteLogits(_message.Message):
    __slots__ = ("replace", "add", "bias", "mask")
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    replace: _tensor_pb2.Tensor
    add: _tensor_pb2.Tensor
    bias: TokenBias
    mask: TokenSet
    def __init__(self, replace: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., add: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bias: _Optional[_Union[TokenBias, _Mapping]] = ..., mask: _Optional[_Union[TokenSet, _Mapping]] = ...) -> None: ...

class TokenBias(_message.Message):
    __slots__ = ("bias",)
    class BiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    BIAS_FIELD_NUMBER: _ClassVar[int]
    bias: _containers.ScalarMap[int, float]
    def __init__(self, bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class WriteModule(_message.Message):
    __slots__ = ("module", "positions", "add", "replace", "zero", "mean", "patch", "add_read", "scale", "units")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    ADD_READ_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    module: str
    positions: Positions
    add: _tensor_pb2.Tensor
    replace: _tensor_pb2.Tensor
    zero: ZeroAblation
    mean: MeanAblation
    patch: ReadRef
    add_read: ReadRef
    scale: float
    units: UnitIds
    def __init__(self, module: _Optional[str] = ..., positions: _Optional[_Union[Positions, _Mapping]] = ..., add: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., replace: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., zero: _Optional[_Union[ZeroAblation, _Mapping]] = ..., mean: _Optional[_Union[MeanAblation, _Mapping]] = ..., patch: _Optional[_Union[ReadRef, _Mapping]] = ..., add_read: _Optional[_Union[ReadRef, _Mapping]] = ..., scale: _Optional[float] = ..., units: _Optional[_Union[UnitIds, _Mapping]] = ...) -> None: ...

class ReadRef(_message.Message):
    __slots__ = ("invoke", "name", "positions")
    INVOKE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    invoke: int
    name: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, invoke: _Optional[int] = ..., name: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ...) -> None: ...

class ZeroAblation(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MeanAblation(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stop(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Condition(_message.Message):
    __slots__ = ("sampled_in", "argmax_in", "text_contains", "text_matches", "token_probability", "entropy", "all_of", "any_of", "dictionary_value")
    SAMPLED_IN_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_IN_FIELD_NUMBER: _ClassVar[int]
    TEXT_CONTAINS_FIELD_NUMBER: _ClassVar[int]
    TEXT_MATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    ALL_OF_FIELD_NUMBER: _ClassVar[int]
    ANY_OF_FIELD_NUMBER: _ClassVar[int]
    NOT_FIELD_NUMBER: _ClassVar[int]
    DICTIONARY_VALUE_FIELD_NUMBER: _ClassVar[int]
    sampled_in: TokenSet
    argmax_in: TokenSet
    text_contains: str
    text_matches: str
    token_probability: TokenProbability
    entropy: Threshold
    all_of: Conditions
    any_of: Conditions
    dictionary_value: DictionaryThreshold
    def __init__(self, sampled_in: _Optional[_Union[TokenSet, _Mapping]] = ..., argmax_in: _Optional[_Union[TokenSet, _Mapping]] = ..., text_contains: _Optional[str] = ..., text_matches: _Optional[str] = ..., token_probability: _Optional[_Union[TokenProbability, _Mapping]] = ..., entropy: _Optional[_Union[Threshold, _Mapping]] = ..., all_of: _Optional[_Union[Conditions, _Mapping]] = ..., any_of: _Optional[_Union[Conditions, _Mapping]] = ..., dictionary_value: _Optional[_Union[DictionaryThreshold, _Mapping]] = ..., **kwargs) -> None: ...

class DictionaryThreshold(_message.Message):
    __slots__ = ("dictionary", "feature", "threshold")
    DICTIONARY_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    dictionary: str
    feature: int
    threshold: Threshold
    def __init__(self, dictionary: _Optional[str] = ..., feature: _Optional[int] = ..., threshold: _Optional[_Union[Threshold, _Mapping]] = ...) -> None: ...

class ReadDictionary(_message.Message):
    __slots__ = ("dictionary", "module", "positions", "top_k", "features", "reconstruction_error")
    DICTIONARY_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    RECONSTRUCTION_ERROR_FIELD_NUMBER: _ClassVar[int]
    dictionary: str
    module: str
    positions: Positions
    top_k: TopK
    features: UnitIds
    reconstruction_error: ReconstructionError
    def __init__(self, dictionary: _Optional[str] = ..., module: _Optional[str] = ..., positions: _Optional[_Union[Positions, _Mapping]] = ..., top_k: _Optional[_Union[TopK, _Mapping]] = ..., features: _Optional[_Union[UnitIds, _Mapping]] = ..., reconstruction_error: _Optional[_Union[ReconstructionError, _Mapping]] = ...) -> None: ...

class ReconstructionError(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WriteDictionary(_message.Message):
    __slots__ = ("dictionary", "module", "positions", "features", "steer", "clamp", "ablate")
    DICTIONARY_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    STEER_FIELD_NUMBER: _ClassVar[int]
    CLAMP_FIELD_NUMBER: _ClassVar[int]
    ABLATE_FIELD_NUMBER: _ClassVar[int]
    dictionary: str
    module: str
    positions: Positions
    features: _containers.RepeatedScalarFieldContainer[int]
    steer: float
    clamp: float
    ablate: FeatureAblation
    def __init__(self, dictionary: _Optional[str] = ..., module: _Optional[str] = ..., positions: _Optional[_Union[Positions, _Mapping]] = ..., features: _Optional[_Iterable[int]] = ..., steer: _Optional[float] = ..., clamp: _Optional[float] = ..., ablate: _Optional[_Union[FeatureAblation, _Mapping]] = ...) -> None: ...

class FeatureAblation(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Conditions(_message.Message):
    __slots__ = ("conditions",)
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    conditions: _containers.RepeatedCompositeFieldContainer[Condition]
    def __init__(self, conditions: _Optional[_Iterable[_Union[Condition, _Mapping]]] = ...) -> None: ...

class TokenProbability(_message.Message):
    __slots__ = ("token_id", "threshold")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    threshold: Threshold
    def __init__(self, token_id: _Optional[int] = ..., threshold: _Optional[_Union[Threshold, _Mapping]] = ...) -> None: ...

class Threshold(_message.Message):
    __slots__ = ("comparison", "value")
    COMPARISON_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    comparison: Comparison
    value: float
    def __init__(self, comparison: _Optional[_Union[Comparison, str]] = ..., value: _Optional[float] = ...) -> None: ...
