"""The gRPC layer: tracewire.v1.TraceService on grpc.aio.

Turns protobuf requests into validated engine calls and engine results back
into protobuf. This is the one place where TracewireErrors become gRPC status
codes; everything below raises them where the problem is detected.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory
from grpc_status import rpc_status
from tracewire.v1 import dictionary_pb2, service_pb2, service_pb2_grpc

from .. import __version__
from ..shared import plan as P
from ..shared.limits import EngineMode
from . import outputs, vllm_compat
from .auth import TokenTable
from .bounds import RequestBounds
from .calls import current_call
from .compiler import check_sequences, compile_trace
from .dictionaries import DictionaryRegistry
from .dictionary_messages import dictionary_names, to_message
from .dictionary_uploads import register_upload
from .engine import Engine
from .errors import Internal, InvalidArgument, TracewireError, Unavailable, to_rpc_status
from .prompts import EnginePrompt, to_engine_prompt
from .sampling import check_token_ids, fit_max_tokens, to_vllm_kwargs
from .tenants import TenantCall, TenantLedger, TenantQuotas

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
T = TypeVar("T")

# Requests under this size are compiled / tokenized on the event loop (microseconds);
# larger ones in a thread.
INLINE_REQUEST_BYTES = 16 << 10


@dataclass(frozen=True)
class Undecodable:
    """A request body that does not parse as the method's message (corrupt bytes, nesting
    past protobuf's recursion limit). grpc would answer UNKNOWN and log a traceback each
    time; the handlers' decorators answer INVALID_ARGUMENT instead."""

    type_name: str
    reason: str

    def error(self) -> InvalidArgument:
        return InvalidArgument("", f"the request body is not a valid {self.type_name}: {self.reason}")


def _lenient(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, RecursionError, ...: all the sender's
            return Undecodable(message_class.DESCRIPTOR.full_name, str(e)[:200] or type(e).__name__)

    return parse


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_to_server(servicer: TraceServicer, server: grpc.aio.Server) -> None:
    """TraceService's handlers, built from its descriptor as the generated
    add_TraceServiceServicer_to_server does, but decoding requests leniently."""
    service = service_pb2.DESCRIPTOR.services_by_name["TraceService"]
    handlers = {}
    for method in service.methods:
        make = _HANDLER_KINDS[method.client_streaming, method.server_streaming]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_lenient(message_factory.GetMessageClass(method.input_type)),
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


async def _abort(context: grpc.aio.ServicerContext, error: TracewireError) -> None:
    await context.abort_with_status(rpc_status.to_status(to_rpc_status(error)))


def _unexpected(method: str, error: Exception) -> TracewireError:
    log.exception("%s failed", method)
    return Internal(f"{method} failed: {type(error).__name__}: {error}")


def unary(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext, TenantCall], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """Admit the call (token, tenant quotas: `TraceServicer._open_call`) and map errors of
    a handler to status codes: a unary one, or a server-streaming one that writes its
    messages with context.write (no async generator per message). The handler gets the
    call's hold on its tenant's quotas, given back however the call ends."""

    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        self.in_flight += 1
        tenant = TenantCall.unmetered()
        try:
            tenant = self._open_call(context)  # (UNAUTHENTICATED before anything else)
            if isinstance(request, Undecodable):
                raise request.error()
            return await fn(self, request, context, tenant)
        except TracewireError as e:
            await _abort(context, e)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug must not look like success
            await _abort(context, _unexpected(fn.__name__, e))
        finally:
            tenant.close()
            self.in_flight -= 1
        raise AssertionError("unreachable: abort raises")

    return handler


def streaming(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext, TenantCall], AsyncIterator[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]:
    """`unary`'s admission and error mapping for an async-generator handler."""

    @functools.wraps(fn)
    async def handler(
        self: Any, request: Req, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Resp]:
        self.in_flight += 1
        tenant = TenantCall.unmetered()
        try:
            tenant = self._open_call(context)  # (UNAUTHENTICATED before anything else)
            if isinstance(request, Undecodable):
                raise request.error()
            # aclosing: the handler's own cleanup (aborting its engine requests) runs before
            # its sequences are given back, not whenever the generator is collected.
            async with contextlib.aclosing(fn(self, request, context, tenant)) as items:
                async for item in items:
                    yield item
        except TracewireError as e:
            await _abort(context, e)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # noqa: BLE001
            await _abort(context, _unexpected(fn.__name__, e))
        finally:
            tenant.close()
            self.in_flight -= 1

    return handler


_ENGINE_MODES: dict[EngineMode, service_pb2.EngineMode.ValueType] = {
    "eager": service_pb2.ENGINE_MODE_EAGER,
    "compiled": service_pb2.ENGINE_MODE_COMPILED,
    "compiled_steering": service_pb2.ENGINE_MODE_COMPILED_STEERING,
}


@dataclass(frozen=True)
class TraceOptions:
    """Server-wide limits for traces."""

    # Largest total of read values one trace may ask for (refused up front).
    max_read_bytes: int = 1 << 30
    # Engine requests one call may make (prompts or invokes x n), checked before any
    # per-sequence work: a careless n must not occupy the server for everyone else.
    max_sequences: int = 256
    # Step results one trace may have waiting for a slow client.
    buffer_bytes: int = 64 << 20
    # Honour fault-injection interventions (tests only).
    fault_injection: bool = False


SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name


class TraceServicer(service_pb2_grpc.TraceServiceServicer):
    """Serves one engine. `engine` is None until it has started."""

    # Streamed deltas buffered per call before the engine side waits for the
    # client; vLLM merges deltas meanwhile, so a slow reader loses nothing.
    STREAM_BUFFER = 64

    def __init__(
        self,
        options: TraceOptions | None = None,
        tokens: TokenTable | None = None,
        quotas: TenantQuotas | None = None,
    ) -> None:
        self.engine: Engine | None = None
        self.draining = False
        self.in_flight = 0  # tracewire calls being served (health and reflection not counted)
        self.options = options or TraceOptions()
        self._traces = itertools.count()
        self._bounds: tuple[Engine, RequestBounds] | None = None
        # --auth-tokens: every call needs a token, and each tenant's calls are counted.
        self._tokens = tokens
        self._ledger = TenantLedger(quotas or TenantQuotas())
        # The dictionaries the engine holds (dictionaries.py); set with `engine`.
        self.dictionaries: DictionaryRegistry | None = None

    def _open_call(self, context: grpc.aio.ServicerContext) -> TenantCall:
        """Who is calling, and their hold on a call slot; the one check on both ports (the
        HTTP gateway's context gives its headers as invocation metadata)."""
        if self._tokens is None:
            return TenantCall.unmetered()
        tenant = self._tokens.tenant_for(context.invocation_metadata() or ())
        call = current_call()  # the access log's and metrics' record of this call
        if call is not None:
            call.tenant = tenant
        return self._ledger.open_call(tenant)

    def _admit(self, request: Any) -> Engine:
        """The engine, once the request is within its bounds (bounds.py)."""
        engine = self._ready()
        if self._bounds is None or self._bounds[0] is not engine:
            self._bounds = (engine, RequestBounds.of(engine.limits))
        self._bounds[1].check(request)
        return engine

    @staticmethod
    async def _off_loop(request: Any, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` for this request: in a thread when the request is large enough
        for its tokenizing or compiling to hold up the other calls on the event loop."""
        if request.ByteSize() < INLINE_REQUEST_BYTES:
            return work(*args)
        return await asyncio.to_thread(work, *args)

    def unavailable(self, method: str) -> Unavailable | None:
        """Why a call of `method` ("package.Service/Method") is refused now; None when it
        is served. TraceService's calls wait for the engine and stop when the server drains;
        health and reflection stay open."""
        if not method.startswith(f"{SERVICE_NAME}/"):
            return None
        if self.draining:
            return Unavailable("the server is shutting down")
        if self.engine is None:
            return Unavailable("the engine is starting; retry when health reports SERVING")
        if self.engine.errored:
            return Unavailable("the engine has failed; the server must be restarted")
        return None

    def _ready(self) -> Engine:
        """The engine, for a call already under way (the call observer refused the calls
        that came while the server was not serving: this catches a drain since)."""
        refused = self.unavailable(f"{SERVICE_NAME}/")
        if refused is not None:
            raise refused
        assert self.engine is not None
        return self.engine

    def _check_model(self, engine: Engine, model: str) -> None:
        if model and model != engine.description.model:
            raise InvalidArgument(
                "model", f"unknown model {model!r}; this server serves {engine.description.model!r}"
            )

    def _plain_request(
        self,
        engine: Engine,
        request: service_pb2.GenerateRequest | service_pb2.GenerateStreamRequest,
    ) -> list[tuple[EnginePrompt, dict[str, Any]]]:
        """Each prompt with its sampling keyword arguments (max_tokens fitted to it)."""
        self._check_model(engine, request.model)
        if not request.prompts:
            raise InvalidArgument("prompts", "at least one prompt is required")
        sampling = to_vllm_kwargs(request.sampling_params, engine.limits, "sampling_params")
        check_sequences(len(request.prompts), "prompts", sampling.get("n", 1), "sampling_params.n",
                        self.options.max_sequences)
        planned = []
        for i, p in enumerate(request.prompts):
            prompt = to_engine_prompt(p, engine, engine.limits, f"prompts[{i}]")
            kw = fit_max_tokens(sampling, len(prompt.token_ids), engine.limits, "sampling_params", f"prompts[{i}]")
            planned.append((prompt, kw))
        return planned

    @unary
    async def Generate(
        self, request: service_pb2.GenerateRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> service_pb2.GenerateResponse:
        engine = self._admit(request)
        planned = await self._off_loop(request, self._plain_request, engine, request)
        tenant.reserve_sequences(sum(kw.get("n", 1) for _, kw in planned))

        async def run(prompt: EnginePrompt, sampling: dict[str, Any]) -> Any:
            final = None
            async for out in engine.generate(prompt, sampling, stream=False):
                final = out
            return outputs.request_output(final, prompt.text)

        # A TaskGroup cancels (and so aborts in the engine) every prompt's request
        # when one fails or the call is cancelled. Its ExceptionGroup is unwrapped: the
        # client gets the first request's own status (INVALID_ARGUMENT, UNAVAILABLE...).
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(run(p, kw)) for p, kw in planned]
        except* TracewireError as errors:
            raise errors.exceptions[0] from None
        return service_pb2.GenerateResponse(outputs=[t.result() for t in tasks])

    @streaming
    async def GenerateStream(
        self, request: service_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> AsyncIterator[service_pb2.GenerateStreamResponse]:
        engine = self._admit(request)
        planned = await self._off_loop(request, self._plain_request, engine, request)
        tenant.reserve_sequences(sum(kw.get("n", 1) for _, kw in planned))
        queue: asyncio.Queue[service_pb2.GenerateStreamResponse | BaseException | None] = (
            asyncio.Queue(self.STREAM_BUFFER)
        )

        async def pump(index: int, prompt: EnginePrompt, sampling: dict[str, Any]) -> None:
            try:
                first = True
                async for out in engine.generate(prompt, sampling, stream=True):
                    message = outputs.request_output(out, prompt.text, include_prompt=first)
                    first = False
                    await queue.put(
                        service_pb2.GenerateStreamResponse(prompt_index=index, output=message)
                    )
                await queue.put(None)
            except Exception as e:  # noqa: BLE001 - handed to the consumer to raise
                await queue.put(e)

        tasks = [asyncio.create_task(pump(i, p, kw)) for i, (p, kw) in enumerate(planned)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            # Client gone, deadline, or an error: abort whatever still runs.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @unary
    async def Trace(  # type: ignore[override]
        self, request: service_pb2.TraceRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> None:
        # Streams through context.write (grpc.aio: a coroutine handler that returns None).
        engine = self._admit(request)
        self._check_model(engine, request.model)
        registry = self._registry()
        if registry.shared:  # another frontend may have registered what it names
            await registry.prefetch(dictionary_names(request))
        compiled = await self._off_loop(request, functools.partial(
            compile_trace,
            request,
            engine.limits,
            engine,
            trace_key=f"{engine.new_request_id()}-t{next(self._traces)}",
            server_max_read_bytes=self.options.max_read_bytes,
            max_sequences=self.options.max_sequences,
            fault_injection=self.options.fault_injection,
            route=engine.route,
            dictionaries=registry.lookup,
        ))
        tenant.reserve_sequences(sum(len(invoke.sequences) for invoke in compiled.invokes))
        tenant.charge_reads(compiled.read_bytes_bound)
        tenant.hold_patch_bytes(compiled.patch_bytes, compiled.patch_source)
        await engine.trace(compiled, self.options.buffer_bytes, registry.unchanged).send(context.write)

    @unary
    async def Tokenize(
        self, request: service_pb2.TokenizeRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> service_pb2.TokenizeResponse:
        engine = self._admit(request)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True

        def tokenize() -> service_pb2.TokenizeResponse:
            ids = engine.encode(request.text, add_special_tokens=add_special)
            return service_pb2.TokenizeResponse(token_ids=ids, tokens=engine.token_strings(ids))

        return await self._off_loop(request, tokenize)

    @unary
    async def Detokenize(
        self, request: service_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> service_pb2.DetokenizeResponse:
        engine = self._admit(request)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True

        def detokenize() -> service_pb2.DetokenizeResponse:
            check_token_ids(request.token_ids, engine.limits, "token_ids")
            return service_pb2.DetokenizeResponse(text=engine.decode(list(request.token_ids), skip_special_tokens=skip))

        return await self._off_loop(request, detokenize)

    @unary
    async def GetModelInfo(
        self, request: service_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> service_pb2.GetModelInfoResponse:
        engine = self._ready()
        d = engine.description
        info = service_pb2.GetModelInfoResponse(
            model=d.model,
            vocab_size=d.vocab_size,
            eos_token_ids=list(d.eos_token_ids),
            max_model_len=d.max_model_len,
            dtype=d.dtype,
            num_layers=d.num_layers,
            hidden_size=d.hidden_size,
            architecture=d.architecture,
            modules=[
                service_pb2.ModuleInfo(path=m.path, kind=m.kind, output_size=m.output_size,
                                       shape=list(m.shape or (m.output_size,)))
                for m in d.modules
            ],
            vllm_version=vllm_compat.VLLM_VERSION,
            server_version=__version__,
            tensor_parallel_size=d.tensor_parallel_size,
            engine_mode=_ENGINE_MODES[engine.limits.engine_mode],
            steerable_layers=sorted(engine.limits.steerable_layers),
            readable_layers=sorted(engine.limits.readable_layers),
            unit_readable_layers=sorted(engine.limits.unit_readable_layers),
            pattern_readable_layers=sorted(engine.limits.pattern_readable_layers),
            readable_modules=sorted(engine.limits.readable_modules, key=P.module_order),
            steerable_modules=sorted(engine.limits.steerable_modules, key=P.module_order),
            compiled_mean_ablation=engine.limits.compiled_means,
            clamp_layers=sorted(engine.limits.clamp_layers),
            unit_steerable_layers=sorted(engine.limits.unit_steerable_layers),
            pipeline_parallel_size=engine.limits.pipeline_parallel_size,
            stage_first_layers=list(engine.limits.stage_first_layers),
            max_lens_rows=engine.limits.max_lens_rows,
            num_attention_heads=d.num_attention_heads,
            num_key_value_heads=d.num_key_value_heads,
            head_dim=d.head_dim,
            intermediate_size=d.intermediate_size,
            attention_patterns_refusal=engine.limits.attention_patterns_refusal(),
        )
        if d.bos_token_id is not None:
            info.bos_token_id = d.bos_token_id
        return info

    @unary
    async def GetEngineStats(
        self, request: service_pb2.GetEngineStatsRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> service_pb2.GetEngineStatsResponse:
        stats = self._ready().stats()
        return service_pb2.GetEngineStatsResponse(
            num_unfinished_requests=stats.unfinished,
            num_running_requests=stats.running,
            num_waiting_requests=stats.waiting,
        )

    # -- dictionaries (dictionaries.py, dictionary_uploads.py) ---------------------------

    def _registry(self) -> DictionaryRegistry:
        self._ready()
        assert self.dictionaries is not None
        return self.dictionaries

    @unary
    async def RegisterDictionary(  # type: ignore[override]
        self,
        request: AsyncIterator[dictionary_pb2.RegisterDictionaryRequest | Undecodable],
        context: grpc.aio.ServicerContext,
        tenant: TenantCall,
    ) -> dictionary_pb2.RegisterDictionaryResponse:
        engine = self._ready()
        info = await register_upload(_decoded(request), _owner(tenant), self._registry(), engine.description)
        return dictionary_pb2.RegisterDictionaryResponse(dictionary=to_message(info))

    @unary
    async def ListDictionaries(
        self, request: dictionary_pb2.ListDictionariesRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> dictionary_pb2.ListDictionariesResponse:
        held = await self._registry().current()
        return dictionary_pb2.ListDictionariesResponse(
            dictionaries=[to_message(info, omit_labels=request.omit_labels) for info in held]
        )

    @unary
    async def DeleteDictionary(
        self, request: dictionary_pb2.DeleteDictionaryRequest, context: grpc.aio.ServicerContext, tenant: TenantCall
    ) -> dictionary_pb2.DeleteDictionaryResponse:
        freed = await self._registry().delete(request.name, _owner(tenant))
        return dictionary_pb2.DeleteDictionaryResponse(freed_bytes=freed)


def _owner(tenant: TenantCall) -> str:
    """Who owns what this call registers: its tenant (--auth-tokens), else everyone's
    "anonymous" (the operator's are "")."""
    return tenant.tenant or "anonymous"


async def _decoded(messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream's messages, a body that does not parse raising INVALID_ARGUMENT."""
    async for message in messages:
        if isinstance(message, Undecodable):
            raise message.error()
        yield message
