"""The asyncio client: the same API as `Client`, awaited.

    async with tracewire.AsyncClient("127.0.0.1:50051") as client:
        outs = await client.generate("The capital of France is", max_tokens=8)
        async with client.trace("The capital of France is", max_tokens=8) as tracer:
            top = tracer.all().logits.top_k(5).save()
        async for step in client.stream_trace("Once upon a time", max_tokens=16):
            print(step.text, end="")
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio

from .client import ModelInfo, StreamUpdate, _prompt_list, model_info, open_channel
from .errors import InvalidArgument, from_rpc_error
from .outputs import RequestOutput, request_output
from .prompts import PromptLike, to_prompt
from .sampling import sampling_params
from .tls import Tls, bearer_metadata, channel_credentials
from .tracing import Step, Tracer
from .v1 import service_pb2, service_pb2_grpc


class AsyncTokenizer:
    """encode / decode through the RPCs, awaited."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        r = await self._client._unary(
            "Tokenize", service_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        )
        return list(r.token_ids)

    async def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        r = await self._client._unary(
            "Detokenize", service_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens)
        )
        return str(r.text)


class AsyncTracer(Tracer):
    """A Tracer run with `async with` / `async for`."""

    def __init__(self, client: AsyncClient, prompt: PromptLike | None, **sampling: Any) -> None:
        super().__init__(_no_sync_run, prompt, **sampling)
        self._client = client

    async def astream(self) -> AsyncIterator[Step]:
        client = self._client
        call = client._stub.Trace(self.start(), timeout=client.timeout, metadata=client._metadata)
        try:
            async for event in call:
                for step in self.handle(event):
                    yield step
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

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
        self._channel: grpc.aio.Channel = open_channel(
            grpc.aio, target, channel_credentials(tls, credentials), options
        )
        self._stub = service_pb2_grpc.TraceServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = bearer_metadata(token)
        self.timeout = timeout
        self.tokenizer = AsyncTokenizer(self)

    async def _unary(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def generate(self, prompts: PromptLike | Sequence[PromptLike], **sampling: Any) -> list[RequestOutput]:
        request = service_pb2.GenerateRequest(
            prompts=[to_prompt(p) for p in _prompt_list(prompts)], sampling_params=sampling_params(**sampling)
        )
        response = await self._unary("Generate", request)
        return [request_output(o) for o in response.outputs]

    async def generate_stream(
        self, prompts: PromptLike | Sequence[PromptLike], **sampling: Any
    ) -> AsyncIterator[StreamUpdate]:
        request = service_pb2.GenerateStreamRequest(
            prompts=[to_prompt(p) for p in _prompt_list(prompts)], sampling_params=sampling_params(**sampling)
        )
        call = self._stub.GenerateStream(request, timeout=self.timeout, metadata=self._metadata)
        try:
            async for message in call:
                yield StreamUpdate(message.prompt_index, request_output(message.output))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    def trace(self, prompt: PromptLike | None = None, **sampling: Any) -> AsyncTracer:
        return AsyncTracer(self, prompt, **sampling)

    def stream_trace(self, trace: AsyncTracer | PromptLike, **sampling: Any) -> AsyncIterator[Step]:
        if not isinstance(trace, AsyncTracer):
            trace = self.trace(trace, **sampling)
        elif sampling:
            raise InvalidArgument("sampling keywords go to client.trace(), not stream_trace(tracer)")
        return trace.astream()

    async def model_info(self) -> ModelInfo:
        return model_info(await self._unary("GetModelInfo", service_pb2.GetModelInfoRequest()))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
