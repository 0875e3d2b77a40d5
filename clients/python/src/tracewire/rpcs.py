"""Each RPC's two pure halves: the request a call sends and what its answers mean.

`Client` and `AsyncClient` (and their tokenizers) build every call here and decode its
answers here, so they differ only in sending it: a blocking stub call or an awaited one,
`for` or `async for` over a stream. A Trace's answers are decoded by its `Tracer`, which
holds the state they fill in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, cast

from google.protobuf.message import Message

from .dictionaries import Dictionary, SpecLike, TensorsLike, chunks, dictionary, header_request
from .outputs import RequestOutput, request_output
from .prompts import PromptLike, to_prompt
from .sampling import sampling_params
from .v1 import dictionary_pb2, service_pb2

T = TypeVar("T")


@dataclass(frozen=True)
class Rpc(Generic[T]):
    """One call: the stub method, its request (the messages of a client stream), and
    `decode` for its response (unary) or for each message (server stream)."""

    method: str
    request: Message | Iterator[Message]
    decode: Callable[[Any], T]


# -- results -----------------------------------------------------------------------

EngineMode = Literal["eager", "compiled", "compiled_steering", "unspecified"]
_ENGINE_MODES: dict[int, EngineMode] = {
    service_pb2.ENGINE_MODE_EAGER: "eager",
    service_pb2.ENGINE_MODE_COMPILED: "compiled",
    service_pb2.ENGINE_MODE_COMPILED_STEERING: "compiled_steering",
}


@dataclass(frozen=True)
class ModuleInfo:
    path: str
    kind: str
    output_size: int
    # Output shape per token position: (hidden,), (heads, head_dim) for
    # "attention_heads", (intermediate,) for "mlp_activation".
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    model: str
    architecture: str
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    max_model_len: int
    dtype: str
    num_layers: int
    hidden_size: int
    tensor_parallel_size: int
    modules: list[ModuleInfo]
    vllm_version: str
    server_version: str
    # How the engine runs: "eager" serves every module read / write and the logit lens;
    # "compiled" no module writes; "compiled_steering" add / replace / zero writes on the
    # decoder layers in `steerable_layers` only ("unspecified": an older server). A
    # compiled engine reads the decoder layers in `readable_layers` (module reads of the
    # layer, the logit lens, probes and SAEs on it), the heads and neurons of those in
    # `unit_readable_layers`, and no other module.
    engine_mode: EngineMode = "unspecified"
    steerable_layers: list[int] = field(default_factory=list)
    # The units of layers.L.self_attn.heads (query heads of head_dim) and
    # layers.L.mlp.act (neurons); 0 from an older server.
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    # Why attention-pattern reads are refused here ("": they are served).
    attention_patterns_refusal: str = ""
    readable_layers: list[int] = field(default_factory=list)
    unit_readable_layers: list[int] = field(default_factory=list)
    unit_steerable_layers: list[int] = field(default_factory=list)
    # The layers whose attention patterns a compiled engine serves (--compiled-pattern-reads).
    pattern_readable_layers: list[int] = field(default_factory=list)
    # The other modules (embed_tokens, layers.L.self_attn, layers.L.mlp, norm) a compiled
    # engine reads / writes (--compiled-module-reads / --compiled-module-steering), and
    # whether its write tables take mean ablations (--compiled-mean-ablation).
    readable_modules: list[str] = field(default_factory=list)
    steerable_modules: list[str] = field(default_factory=list)
    compiled_mean_ablation: bool = False
    # The layers whose graph tables clamp and ablate SAE features (--compiled-dictionary-clamps).
    clamp_layers: list[int] = field(default_factory=list)
    # Pipeline stages and the first decoder layer of each (the logit lens and conditions
    # read only the last stage's layers); 1 and [0] without stages (and from an older server).
    pipeline_parallel_size: int = 1
    stage_first_layers: list[int] = field(default_factory=lambda: [0])
    # The most residual streams a trace's logit-lens reads may put through lm_head at one
    # step (layers x positions x sequences); 0 from an older server, which does not say.
    max_lens_rows: int = 0


@dataclass(frozen=True)
class EngineStats:
    """GetEngineStats: the engine's load now. With --frontends, `num_unfinished_requests`
    counts the answering process's requests, and the scheduler's counts read 0."""

    num_unfinished_requests: int  # requests the server has in the engine, not yet finished
    num_running_requests: int  # running at the scheduler's last step
    num_waiting_requests: int  # waiting at the scheduler's last step


@dataclass(frozen=True)
class StreamUpdate:
    """One streamed update: which prompt, and what is new since its last update."""

    prompt_index: int
    output: RequestOutput


# -- the RPCs ----------------------------------------------------------------------


def generate(prompts: PromptLike | Sequence[PromptLike], sampling: Mapping[str, Any]) -> Rpc[list[RequestOutput]]:
    request = service_pb2.GenerateRequest(
        prompts=[to_prompt(p) for p in prompt_list(prompts)], sampling_params=sampling_params(**sampling)
    )
    return Rpc("Generate", request, _request_outputs)


def generate_stream(prompts: PromptLike | Sequence[PromptLike], sampling: Mapping[str, Any]) -> Rpc[StreamUpdate]:
    request = service_pb2.GenerateStreamRequest(
        prompts=[to_prompt(p) for p in prompt_list(prompts)], sampling_params=sampling_params(**sampling)
    )
    return Rpc("GenerateStream", request, _stream_update)


def trace(request: service_pb2.TraceRequest) -> Rpc[service_pb2.TraceResponse]:
    """A Trace call; its events go to `Tracer.handle` as they are."""
    return Rpc("Trace", request, _as_is)


def tokenize(text: str, add_special_tokens: bool) -> Rpc[list[int]]:
    request = service_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
    return Rpc("Tokenize", request, _token_ids)


def detokenize(token_ids: int | Sequence[int], skip_special_tokens: bool) -> Rpc[str]:
    ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
    request = service_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens)
    return Rpc("Detokenize", request, _text)


def get_model_info() -> Rpc[ModelInfo]:
    return Rpc("GetModelInfo", service_pb2.GetModelInfoRequest(), model_info)


def get_engine_stats() -> Rpc[EngineStats]:
    return Rpc("GetEngineStats", service_pb2.GetEngineStatsRequest(), engine_stats)


def register_dictionary(name: str, spec: SpecLike, tensors: TensorsLike, replace: bool) -> Rpc[Dictionary]:
    """A RegisterDictionary stream: the header, then the safetensors file in chunks (read
    or encoded as the stream is sent)."""
    header = header_request(name, spec, replace)  # (a bad spec raises before any call)

    def requests() -> Iterator[Message]:
        yield header
        for chunk in chunks(tensors):
            yield dictionary_pb2.RegisterDictionaryRequest(chunk=chunk)

    return Rpc("RegisterDictionary", requests(), _registered)


def list_dictionaries(omit_labels: bool) -> Rpc[list[Dictionary]]:
    return Rpc("ListDictionaries", dictionary_pb2.ListDictionariesRequest(omit_labels=omit_labels), _dictionaries)


def delete_dictionary(name: str) -> Rpc[int]:
    return Rpc("DeleteDictionary", dictionary_pb2.DeleteDictionaryRequest(name=name), _freed_bytes)


def prompt_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
    """One prompt or a list of prompts -> a list (a list of ints is one prompt)."""
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
        return [cast(PromptLike, prompts)]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [cast(PromptLike, prompts)]
    return list(cast(Sequence[PromptLike], prompts))


# -- decoding ----------------------------------------------------------------------


def model_info(r: service_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model=r.model,
        architecture=r.architecture,
        vocab_size=r.vocab_size,
        eos_token_ids=list(r.eos_token_ids),
        bos_token_id=r.bos_token_id if r.HasField("bos_token_id") else None,
        max_model_len=r.max_model_len,
        dtype=r.dtype,
        num_layers=r.num_layers,
        hidden_size=r.hidden_size,
        tensor_parallel_size=r.tensor_parallel_size,
        modules=[ModuleInfo(m.path, m.kind, m.output_size, tuple(m.shape)) for m in r.modules],
        vllm_version=r.vllm_version,
        server_version=r.server_version,
        engine_mode=_ENGINE_MODES.get(r.engine_mode, "unspecified"),
        steerable_layers=list(r.steerable_layers),
        num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads,
        head_dim=r.head_dim,
        intermediate_size=r.intermediate_size,
        attention_patterns_refusal=r.attention_patterns_refusal,
        readable_layers=list(r.readable_layers),
        unit_readable_layers=list(r.unit_readable_layers),
        unit_steerable_layers=list(r.unit_steerable_layers),
        pattern_readable_layers=list(r.pattern_readable_layers),
        readable_modules=list(r.readable_modules),
        steerable_modules=list(r.steerable_modules),
        compiled_mean_ablation=r.compiled_mean_ablation,
        clamp_layers=list(r.clamp_layers),
        pipeline_parallel_size=r.pipeline_parallel_size or 1,
        stage_first_layers=list(r.stage_first_layers) or [0],
        max_lens_rows=r.max_lens_rows,
    )


def engine_stats(r: service_pb2.GetEngineStatsResponse) -> EngineStats:
    return EngineStats(r.num_unfinished_requests, r.num_running_requests, r.num_waiting_requests)


def _request_outputs(response: service_pb2.GenerateResponse) -> list[RequestOutput]:
    return [request_output(o) for o in response.outputs]


def _stream_update(message: service_pb2.GenerateStreamResponse) -> StreamUpdate:
    return StreamUpdate(message.prompt_index, request_output(message.output))


def _token_ids(response: service_pb2.TokenizeResponse) -> list[int]:
    return list(response.token_ids)


def _text(response: service_pb2.DetokenizeResponse) -> str:
    return str(response.text)


def _registered(response: dictionary_pb2.RegisterDictionaryResponse) -> Dictionary:
    return dictionary(response.dictionary)


def _dictionaries(response: dictionary_pb2.ListDictionariesResponse) -> list[Dictionary]:
    return [dictionary(d) for d in response.dictionaries]


def _freed_bytes(response: dictionary_pb2.DeleteDictionaryResponse) -> int:
    return int(response.freed_bytes)


def _as_is(message: T) -> T:
    return message
