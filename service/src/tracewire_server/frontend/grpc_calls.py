"""The gRPC port's calls observed: a grpc.aio interceptor that gives each call its request
id (sent at once in the initial metadata), counts the bytes of the messages it sends, and
finishes it (metrics, access log) with the status the client got.

A call the server cannot serve now (draining, or its engine not up) is refused here, before
the initial metadata: a response that has not begun is one a client's channel may retry on
another replica (gRPC's retry policy stops at the first response byte). Its request id goes
in the trailers instead."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import grpc
from grpc_status import rpc_status

from .calls import REQUEST_ID_HEADER, Call, request_id
from .errors import TracewireError, to_rpc_status

# Why a call of this method ("package.Service/Method") is refused now; None: it is served.
Refusal = Callable[[str], TracewireError | None]


class CallObserver(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, refusal: Refusal | None = None) -> None:
        self._refusal = refusal

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:  # an unknown method: grpc answers UNIMPLEMENTED itself
            return handler
        offered = next((v for k, v in details.invocation_metadata or () if k == REQUEST_ID_HEADER), None)
        call = Call("grpc", details.method.lstrip("/"), request_id(offered), peer="")
        return _observed(handler, call, self._refusal)


def _observed(handler: Any, call: Call, refusal: Refusal | None) -> Any:
    """`handler` (a grpc RpcMethodHandler namedtuple) with its behavior wrapped and its
    response serializer counting bytes. A new handler per call: the call is bound here."""
    name = next(n for n in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, n))
    behavior = getattr(handler, name)
    if inspect.isasyncgenfunction(behavior):
        wrapped: Any = _stream(behavior, call, refusal)
    elif inspect.iscoroutinefunction(behavior):
        # A single response is serialized after the call is finished: it is counted there.
        wrapped = _coroutine(behavior, call, refusal, single_response=name.endswith("_unary"))
    else:  # a synchronous handler (none is served): left as it is, uncounted
        return handler
    changes: dict[str, Any] = {name: wrapped}
    serialize = handler.response_serializer
    if serialize is not None and name.endswith("_stream"):

        def counted(message: Any) -> bytes:
            data: bytes = serialize(message)
            call.bytes_sent += len(data)
            return data

        changes["response_serializer"] = counted
    return handler._replace(**changes)


async def _begin(call: Call, context: grpc.aio.ServicerContext, refusal: Refusal | None) -> None:
    call.peer = _peer(context.peer())
    call.enter()
    refused = refusal(call.method) if refusal is not None else None
    if refused is not None:
        status = rpc_status.to_status(to_rpc_status(refused))
        await context.abort(status.code, status.details,
                            trailing_metadata=(*status.trailing_metadata, (REQUEST_ID_HEADER, call.request_id)))
    await context.send_initial_metadata(((REQUEST_ID_HEADER, call.request_id),))


def _coroutine(
    behavior: Callable[..., Awaitable[Any]], call: Call, refusal: Refusal | None, single_response: bool
) -> Callable[..., Awaitable[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await _begin(call, context, refusal)
            result = await behavior(request, context)
        except BaseException as e:
            call.code = _failed_code(e, context)
            raise
        else:
            call.code = _code_name(context.code()) or "OK"
            if single_response and result is not None:
                call.bytes_sent += result.ByteSize()
            return result
        finally:
            call.finish()

    return run


def _stream(
    behavior: Callable[..., AsyncIterator[Any]], call: Call, refusal: Refusal | None
) -> Callable[..., AsyncIterator[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            await _begin(call, context, refusal)
            async for message in behavior(request, context):
                yield message
        except BaseException as e:
            call.code = _failed_code(e, context)
            raise
        else:
            call.code = _code_name(context.code()) or "OK"
        finally:
            call.finish()

    return run


def _failed_code(error: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        # The client went away, or its deadline passed (grpc cancels the handler for both).
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    # An abort set the code; anything else reaches the client as UNKNOWN.
    return _code_name(context.code()) or "UNKNOWN"


def _code_name(code: Any) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # (grpc.aio may keep the raw number)
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    return ""


def _peer(peer: str) -> str:
    """grpc's `ipv4:127.0.0.1:5555` / `ipv6:%5B::1%5D:5555` as `127.0.0.1:5555` / `[::1]:5555`."""
    kind, _, address = peer.partition(":")
    return unquote(address) if kind in ("ipv4", "ipv6") else peer
