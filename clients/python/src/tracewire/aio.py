"""The asyncio client: the same API as `Client`, awaited.

    async with tracewire.AsyncClient("127.0.0.1:50051") as client:
        outs = await client.generate("The capital of France is", max_tokens=8)
        async with client.trace("The capital of France is", max_tokens=8) as tracer:
            top = tracer.all().logits.top_k(5).save()
        async for step in client.stream_trace("Once upon a time", max_tokens=16):
            print(step.text, end="")

Each call's request and decoding come from rpcs.py, as the sync client's do; this module
only awaits them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from . import rpcs
from .channel import connect
from .dictionaries import Dictionary, SpecLike, TensorsLike
from .errors import InvalidArgument, TypedErrors
from .mapping import MapOptions, MapResults, run_map_async
from .outputs import RequestOutput
from .prompts import PromptLike
from .rpcs import EngineStats, ModelInfo, Rpc, StreamUpdate
from .tls import Tls
from .tokenizer import AsyncTokenizer
from .tracing import Step, Tracer
from .v1 import service_pb2

T = TypeVar("T")
R = TypeVar("R")

AsyncRunner = Callable[[service_pb2.TraceRequest], AsyncIterator[service_pb2.TraceResponse]]


class AsyncTracer(Tracer):
    """A Tracer run with `async with` / `async for`."""

    def __init__(self, runner: AsyncRunner, prompt: PromptLike | None, **sampling: Any) -> None:
        super().__init__(_no_sync_run, prompt, **sampling)
        self._async_runner = runner

    async def astream(self) -> AsyncIterator[Step]:
        async for event in self._async_runner(self.start()):
            for step in self.handle(event):
                yield step

    async def arun(self) -> AsyncTracer:
        async for _ in self.astream():
            pass
        return self

    def __enter__(self) -> AsyncTracer:
        raise TypeError("use `async with client.trace(...)` with AsyncClient")

    async def __aenter__(self) -> AsyncTracer:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            await self.arun()


def _no_sync_run(request: service_pb2.TraceRequest) -> Any:
    raise TypeError("an AsyncClient trace runs with `async with` or `async for`")


class AsyncClient:
    """An asyncio connection to a tracewire server (see `Client` for the arguments)."""

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
        connection = connect(grpc.aio, target, token=token, tls=tls, credentials=credentials, options=options)
        self._target = target
        self._channel: grpc.aio.Channel = connection.channel
        self._stub = connection.stub
        self._metadata = connection.metadata
        self.timeout = timeout
        self.tokenizer = AsyncTokenizer(self._unary)

    # -- I/O ----------------------------------------------------------------------

    async def _unary(self, rpc: Rpc[T]) -> T:
        with TypedErrors(self._target):
            response = await getattr(self._stub, rpc.method)(
                rpc.request, timeout=self.timeout, metadata=self._metadata
            )
        return rpc.decode(response)

    async def _stream(self, rpc: Rpc[T]) -> AsyncIterator[T]:
        call = getattr(self._stub, rpc.method)(rpc.request, timeout=self.timeout, metadata=self._metadata)
        try:
            with TypedErrors(self._target):
                async for message in call:
                    yield rpc.decode(message)
        finally:
            call.cancel()

    def _run_trace(self, request: service_pb2.TraceRequest) -> AsyncIterator[service_pb2.TraceResponse]:
        return self._stream(rpcs.trace(request))

    # -- public API -------------------------------------------------------------

    async def generate(self, prompts: PromptLike | Sequence[PromptLike], **sampling: Any) -> list[RequestOutput]:
        return await self._unary(rpcs.generate(prompts, sampling))

    async def generate_stream(
        self, prompts: PromptLike | Sequence[PromptLike], **sampling: Any
    ) -> AsyncIterator[StreamUpdate]:
        async for update in self._stream(rpcs.generate_stream(prompts, sampling)):
            yield update

    def trace(self, prompt: PromptLike | None = None, **sampling: Any) -> AsyncTracer:
        return AsyncTracer(self._run_trace, prompt, **sampling)

    def stream_trace(self, trace: AsyncTracer | PromptLike, **sampling: Any) -> AsyncIterator[Step]:
        if not isinstance(trace, AsyncTracer):
            trace = self.trace(trace, **sampling)
        elif sampling:
            raise InvalidArgument("sampling keywords go to client.trace(), not stream_trace(tracer)")
        return trace.astream()

    async def map(
        self,
        prompts: Iterable[PromptLike],
        trace_fn: Callable[[AsyncTracer], R],
        *,
        concurrency: int = 8,
        retries: int = 2,
        progress: bool | None = None,
        **sampling: Any,
    ) -> MapResults[R]:
        """`Client.map`, awaited: at most `concurrency` traces in flight on this channel."""
        return await run_map_async(self, prompts, trace_fn, MapOptions(concurrency, retries, progress), sampling)

    async def register_dictionary(
        self, name: str, spec: SpecLike, tensors: TensorsLike, *, replace: bool = False
    ) -> Dictionary:
        """Upload a dictionary (a linear probe or an SAE) under `name`: `spec` is a mapping
        ({"kind": "probe", "module": "layers.2", "probe_activation": "sigmoid", "labels":
        [...]}), a DictionarySpec or a NAME.json path; `tensors` a mapping of arrays ("W", "b";
        or "W_enc", "b_enc", "W_dec", "b_dec", "threshold"), safetensors bytes or a
        .safetensors path. `replace`: replace your own dictionary of that name. Returns it as
        the server holds it."""
        return await self._unary(rpcs.register_dictionary(name, spec, tensors, replace))

    async def list_dictionaries(self, *, omit_labels: bool = False) -> list[Dictionary]:
        """Every dictionary the server holds (the operator's have owner "")."""
        return await self._unary(rpcs.list_dictionaries(omit_labels))

    async def delete_dictionary(self, name: str) -> int:
        """Remove a dictionary you registered; the device bytes freed."""
        return await self._unary(rpcs.delete_dictionary(name))

    async def model_info(self) -> ModelInfo:
        return await self._unary(rpcs.get_model_info())

    async def engine_stats(self) -> EngineStats:
        """GetEngineStats: requests in the engine now (unfinished, running, waiting)."""
        return await self._unary(rpcs.get_engine_stats())

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
