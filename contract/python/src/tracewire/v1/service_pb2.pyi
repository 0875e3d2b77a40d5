from tracewire.v1 import dictionary_pb2 as _dictionary_pb2
from tracewire.v1 import output_pb2 as _output_pb2
from tracewire.v1 import prompt_pb2 as _prompt_pb2
from tracewire.v1 import sampling_pb2 as _sampling_pb2
from tracewire.v1 import trace_pb2 as _trace_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_MODE_UNSPECIFIED: _ClassVar[EngineMode]
    ENGINE_MODE_EAGER: _ClassVar[EngineMode]
    ENGINE_MODE_COMPILED: _ClassVar[EngineMode]
    ENGINE_MODE_COMPILED_STEERING: _ClassVar[EngineMode]
ENGINE_MODE_UNSPECIFIED: EngineMode
ENGINE_MODE_EAGER: EngineMode
ENGINE_MODE_COMPILED: EngineMode
ENGINE_MODE_COMPILED_STEERING: EngineMode

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling_params", "model")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_prompt_pb2.Prompt]
    sampling_params: _sampling_pb2.SamplingParams
    model: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[_prompt_pb2.Prompt, _Mapping]]] = ..., sampling_params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[_output_pb2.RequestOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[_output_pb2.RequestOutput, _Mapping]]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("prompts", "sampling_params", "model")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_prompt_pb2.Prompt]
    sampling_params: _sampling_pb2.SamplingParams
    model: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[_prompt_pb2.Prompt, _Mapping]]] = ..., sampling_params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("prompt_index", "output")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    output: _output_pb2.RequestOutput
    def __init__(self, prompt_index: _Optional[int] = ..., output: _Optional[_Union[_output_pb2.RequestOutput, _Mapping]] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("sampling_params", "invokes", "options", "model")
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    INVOKES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    sampling_params: _sampling_pb2.SamplingParams
    invokes: _containers.RepeatedCompositeFieldContainer[_trace_pb2.Invoke]
    options: _trace_pb2.TraceOptions
    model: str
    def __init__(self, sampling_params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., invokes: _Optional[_Iterable[_Union[_trace_pb2.Invoke, _Mapping]]] = ..., options: _Optional[_Union[_trace_pb2.TraceOptions, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class TraceResponse(_message.Message):
    __slots__ = ("steps", "invoke_result", "end")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INVOKE_RESULT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    steps: _trace_pb2.StepResults
    invoke_result: _trace_pb2.InvokeResult
    end: _trace_pb2.TraceEnd
    def __init__(self, steps: _Optional[_Union[_trace_pb2.StepResults, _Mapping]] = ..., invoke_result: _Optional[_Union[_trace_pb2.InvokeResult, _Mapping]] = ..., end: _Optional[_Union[_trace_pb2.TraceEnd, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "eos_token_ids", "bos_token_id", "max_model_len", "dtype", "num_layers", "hidden_size", "architecture", "modules", "vllm_version", "server_version", "tensor_parallel_size", "engine_mode", "steerable_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "attention_patterns_refusal", "readable_layers", "pipeline_parallel_size", "stage_first_layers", "max_lens_rows", "unit_readable_layers", "unit_steerable_layers", "pattern_readable_layers", "readable_modules", "steerable_modules", "compiled_mean_ablation", "clamp_layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MODE_FIELD_NUMBER: _ClassVar[int]
    STEERABLE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_PATTERNS_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    READABLE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIRST_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LENS_ROWS_FIELD_NUMBER: _ClassVar[int]
    UNIT_READABLE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    UNIT_STEERABLE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PATTERN_READABLE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    READABLE_MODULES_FIELD_NUMBER: _ClassVar[int]
    STEERABLE_MODULES_FIELD_NUMBER: _ClassVar[int]
    COMPILED_MEAN_ABLATION_FIELD_NUMBER: _ClassVar[int]
    CLAMP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    max_model_len: int
    dtype: str
    num_layers: int
    hidden_size: int
    architecture: str
    modules: _containers.RepeatedCompositeFieldContainer[ModuleInfo]
    vllm_version: str
    server_version: str
    tensor_parallel_size: int
    engine_mode: EngineMode
    steerable_layers: _containers.RepeatedScalarFieldContainer[int]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    attention_patterns_refusal: str
    readable_layers: _containers.RepeatedScalarFieldContainer[int]
    pipeline_parallel_size: int
    stage_first_layers: _containers.RepeatedScalarFieldContainer[int]
    max_lens_rows: int
    unit_readable_layers: _containers.RepeatedScalarFieldContainer[int]
    unit_steerable_layers: _containers.RepeatedScalarFieldContainer[int]
    pattern_readable_layers: _containers.RepeatedScalarFieldContainer[int]
    readable_modules: _containers.RepeatedScalarFieldContainer[str]
    steerable_modules: _containers.RepeatedScalarFieldContainer[str]
    compiled_mean_ablation: bool
    clamp_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., architecture: _Optional[str] = ..., modules: _Optional[_Iterable[_Union[ModuleInfo, _Mapping]]] = ..., vllm_version: _Optional[str] = ..., server_version: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., engine_mode: _Optional[_Union[EngineMode, str]] = ..., steerable_layers: _Optional[_Iterable[int]] = ..., num_attention_heads: _Optional[int] = ..., num_key_value_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., attention_patterns_refusal: _Optional[str] = ..., readable_layers: _Optional[_Iterable[int]] = ..., pipeline_parallel_size: _Optional[int] = ..., stage_first_layers: _Optional[_Iterable[int]] = ..., max_lens_rows: _Optional[int] = ..., unit_readable_layers: _Optional[_Iterable[int]] = ..., unit_steerable_layers: _Optional[_Iterable[int]] = ..., pattern_readable_layers: _Optional[_Iterable[int]] = ..., readable_modules: _Optional[_Iterable[str]] = ..., steerable_modules: _Optional[_Iterable[str]] = ..., compiled_mean_ablation: _Optional[bool] = ..., clamp_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class ModuleInfo(_message.Message):
    __slots__ = ("path", "kind", "output_size", "shape")
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    path: str
    kind: str
    output_size: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, path: _Optional[str] = ..., kind: _Optional[str] = ..., output_size: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class GetEngineStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEngineStatsResponse(_message.Message):
    __slots__ = ("num_unfinished_requests", "num_running_requests", "num_waiting_requests")
    NUM_UNFINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_unfinished_requests: int
    num_running_requests: int
    num_waiting_requests: int
    def __init__(self, num_unfinished_requests: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ...) -> None: ...
