import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tracewire.v1 import intervention_pb2 as _intervention_pb2
from tracewire.v1 import output_pb2 as _output_pb2
from tracewire.v1 import prompt_pb2 as _prompt_pb2
from tracewire.v1 import sampling_pb2 as _sampling_pb2
from tracewire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Invoke(_message.Message):
    __slots__ = ("prompt", "sampling_params", "interventions")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    INTERVENTIONS_FIELD_NUMBER: _ClassVar[int]
    prompt: _prompt_pb2.Prompt
    sampling_params: _sampling_pb2.SamplingParams
    interventions: _containers.RepeatedCompositeFieldContainer[_intervention_pb2.Intervention]
    def __init__(self, prompt: _Optional[_Union[_prompt_pb2.Prompt, _Mapping]] = ..., sampling_params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., interventions: _Optional[_Iterable[_Union[_intervention_pb2.Intervention, _Mapping]]] = ...) -> None: ...

class TraceOptions(_message.Message):
    __slots__ = ("max_read_bytes", "stream_every_step", "stream_interval_ms")
    MAX_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_EVERY_STEP_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    max_read_bytes: int
    stream_every_step: bool
    stream_interval_ms: int
    def __init__(self, max_read_bytes: _Optional[int] = ..., stream_every_step: _Optional[bool] = ..., stream_interval_ms: _Optional[int] = ...) -> None: ...

class ReadValue(_message.Message):
    __slots__ = ("values", "token_ids", "positions")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    values: _tensor_pb2.Tensor
    token_ids: _tensor_pb2.Tensor
    positions: _tensor_pb2.Tensor
    def __init__(self, values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., positions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("invoke_index", "sequence_index", "step", "token_id", "text_delta", "values", "stopped", "engine_time")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ReadValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ReadValue, _Mapping]] = ...) -> None: ...
    INVOKE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TIME_FIELD_NUMBER: _ClassVar[int]
    invoke_index: int
    sequence_index: int
    step: int
    token_id: int
    text_delta: str
    values: _containers.MessageMap[str, ReadValue]
    stopped: bool
    engine_time: _timestamp_pb2.Timestamp
    def __init__(self, invoke_index: _Optional[int] = ..., sequence_index: _Optional[int] = ..., step: _Optional[int] = ..., token_id: _Optional[int] = ..., text_delta: _Optional[str] = ..., values: _Optional[_Mapping[str, ReadValue]] = ..., stopped: _Optional[bool] = ..., engine_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class StepResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class InvokeResult(_message.Message):
    __slots__ = ("invoke_index", "output")
    INVOKE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    invoke_index: int
    output: _output_pb2.RequestOutput
    def __init__(self, invoke_index: _Optional[int] = ..., output: _Optional[_Union[_output_pb2.RequestOutput, _Mapping]] = ...) -> None: ...

class TraceWarning(_message.Message):
    __slots__ = ("code", "message", "invoke_index", "intervention")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INVOKE_INDEX_FIELD_NUMBER: _ClassVar[int]
    INTERVENTION_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    invoke_index: int
    intervention: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., invoke_index: _Optional[int] = ..., intervention: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "elapsed_seconds", "read_bytes")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    elapsed_seconds: float
    read_bytes: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., elapsed_seconds: _Optional[float] = ..., read_bytes: _Optional[int] = ...) -> None: ...

class TraceEnd(_message.Message):
    __slots__ = ("warnings", "usage")
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    warnings: _containers.RepeatedCompositeFieldContainer[TraceWarning]
    usage: Usage
    def __init__(self, warnings: _Optional[_Iterable[_Union[TraceWarning, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...
