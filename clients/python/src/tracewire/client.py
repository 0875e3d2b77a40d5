"""The synchronous client."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import grpc

from .errors import InvalidArgument, from_rpc_error
from .outputs import RequestOutput, request_output
from .prompts import PromptLike, to_prompt
from .sampling import sampling_params
from .tls import Tls, bearer_metadata, channel_credentials
from .tokenizer import RemoteTokenizer
from .tracing import Step, Tracer
from .v1 import service_pb2, service_pb2_grpc

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
    # "compiled" none of them; "compiled_steering" add / replace / zero writes on the
    # decoder layers in `steerable_layers` only ("unspecified": an older server).
    engine_mode: EngineMode = "unspecified"
    steerable_layers: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StreamUpdate:
    """One streamed update: which prompt, and what is new since its last update."""

    prompt_index: int
    output: RequestOutput


def open_channel(
    api: Any, target: str, credentials: grpc.ChannelCredentials | None, options: Sequence[tuple[str, Any]]
) -> Any:
    """A channel from `api` (grpc or grpc.aio: the same factory functions), TLS when
    credentials are given. Full-vocabulary reads make large messages."""
    opts = [("grpc.max_receive_message_length", 256 * 1024 * 1024), *options]
    if credentials is None:
        return api.insecure_channel(target, options=opts)
    return api.secure_channel(target, credentials, options=opts)


class Client:
    """A connection to a tracewire server.

    `target` is "host:port". `token`: the bearer token of a server started with
    --auth-tokens, sent with every call. `tls`: True for TLS trusting the system's CAs, or
    a `Tls` (a CA to trust, a client certificate for mutual TLS); `credentials`, any
    grpc.ChannelCredentials instead. `timeout` is the default deadline in seconds for
    every call.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: Tls | bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._channel: grpc.Channel = open_channel(grpc, target, channel_credentials(tls, credentials), options)
        self._stub = service_pb2_grpc.TraceServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = bearer_metadata(token)
        self.timeout = timeout
        self.tokenizer = RemoteTokenizer(self._unary)

    # -- plumbing ---------------------------------------------------------------

    def _unary(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # -- public API -------------------------------------------------------------

    def generate(
        self, prompts: PromptLike | Sequence[PromptLike], **sampling: Any
    ) -> list[RequestOutput]:
        """Plain generation, like vLLM's LLM.generate: one RequestOutput per prompt.

        `prompts` is one prompt or a list of them; keywords are vLLM's
        SamplingParams fields (a misspelled one raises InvalidArgument).
        """
        request = service_pb2.GenerateRequest(
            prompts=[to_prompt(p) for p in _prompt_list(prompts)],
            sampling_params=sampling_params(**sampling),
        )
        response = self._unary("Generate", request)
        return [request_output(o) for o in response.outputs]

    def generate_stream(
        self, prompts: PromptLike | Sequence[PromptLike], **sampling: Any
    ) -> Iterator[StreamUpdate]:
        """Plain generation, streamed: deltas (new text and token ids) as they come."""
        request = service_pb2.GenerateStreamRequest(
            prompts=[to_prompt(p) for p in _prompt_list(prompts)],
            sampling_params=sampling_params(**sampling),
        )
        call = self._stub.GenerateStream(request, timeout=self.timeout, metadata=self._metadata)
        try:
            for message in call:
                yield StreamUpdate(message.prompt_index, request_output(message.output))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    def trace(self, prompt: PromptLike | None = None, **sampling: Any) -> Tracer:
        """A trace; used as `with client.trace(prompt, **sampling) as tracer:` it runs on exit.

        Without a prompt, add prompts with `tracer.invoke(prompt, **overrides)`.
        """
        return Tracer(self._run_trace, prompt, **sampling)

    def stream_trace(self, trace: Tracer | PromptLike, **sampling: Any) -> Iterator[Step]:
        """Run a trace built with `client.trace(...)` (not entered), or a plain prompt, and
        yield each step as it arrives. Saved values and `.result` fill in meanwhile."""
        if not isinstance(trace, Tracer):
            trace = self.trace(trace, **sampling)
        elif sampling:
            raise InvalidArgument("sampling keywords go to client.trace(), not stream_trace(tracer)")
        return trace.events()

    def _run_trace(self, request: service_pb2.TraceRequest) -> Iterator[service_pb2.TraceResponse]:
        call = self._stub.Trace(request, timeout=self.timeout, metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    def model_info(self) -> ModelInfo:
        r = self._unary("GetModelInfo", service_pb2.GetModelInfoRequest())
        return model_info(r)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        modules=[ModuleInfo(m.path, m.kind, m.output_size) for m in r.modules],
        vllm_version=r.vllm_version,
        server_version=r.server_version,
        engine_mode=_ENGINE_MODES.get(r.engine_mode, "unspecified"),
        steerable_layers=list(r.steerable_layers),
    )


def _prompt_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
    """One prompt or a list of prompts -> a list (a list of ints is one prompt)."""
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
        return [cast(PromptLike, prompts)]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [cast(PromptLike, prompts)]
    return list(cast(Sequence[PromptLike], prompts))
