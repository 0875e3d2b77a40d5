"""Typed exceptions, one per gRPC status code the service uses.

Every RPC error surfaces as a subclass of TracewireError; InvalidArgument also
carries the path of the offending request field (from the status's
google.rpc.BadRequest detail).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2


class TracewireError(Exception):
    """An error from the tracewire service (or raised by the SDK before sending)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: Path of the offending request field, when the error names one.
        self.field = field


class InvalidArgument(TracewireError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(TracewireError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(TracewireError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TracewireError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(TracewireError):
    code = grpc.StatusCode.UNAVAILABLE


class Unreachable(Unavailable):
    """No server answered at the client's target: nothing listening there (connection
    refused), a name that does not resolve, a host that cannot be reached. Its message is
    one line naming the target and how to give another; `target` and `reason` say the
    same for code that reports it its own way (the CLI names its --target flag)."""

    def __init__(self, target: str, reason: str) -> None:
        super().__init__(f"cannot reach a tracewire server at {target} ({reason}): start one (make serve), "
                         'or pass its address: tracewire.Client("HOST:PORT")')
        self.target = target
        self.reason = reason

    def __reduce__(self) -> tuple[type[Unreachable], tuple[str, str]]:  # (pickle, copy: its own arguments)
        return (type(self), (self.target, self.reason))


class DeadlineExceeded(TracewireError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(TracewireError):
    code = grpc.StatusCode.CANCELLED


class Unimplemented(TracewireError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(TracewireError):
    code = grpc.StatusCode.INTERNAL


class AlreadyExists(TracewireError):
    """A name is taken (register_dictionary without replace=True)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(TracewireError):
    """Not the caller's to change (another client's or the operator's dictionary)."""

    code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE: dict[grpc.StatusCode, type[TracewireError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        FailedPrecondition,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Unimplemented,
        Internal,
        AlreadyExists,
        PermissionDenied,
    )
}


def from_rpc_error(error: grpc.RpcError, target: str | None = None) -> TracewireError:
    """The typed exception for a failed call, the same for both clients. With the
    channel's `target`, a call that never reached a server is `Unreachable`.

    The sync client's errors are grpc.Call objects; the async client's are
    grpc.aio.AioRpcError, which is not one, so grpc_status's from_call (sync calls
    only) cannot serve both. Both carry the status detail in the same trailing
    metadata, so it is decoded from there, once, for either kind.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    reason = unreachable_reason(code, message or "") if target is not None else None
    if target is not None and reason is not None:
        return Unreachable(target, reason)
    cls = _BY_CODE.get(code, TracewireError)
    result = cls(message or str(code), field=_violated_field(_rich_status(error, code)))
    result.code = code
    return result


# gRPC core's words for a call that found no server: every address refused or timed out
# ("failed to connect to all addresses; last error: ...: Connection refused"), or the name did
# not resolve ("errors resolving HOST:PORT: ..."; older cores: "DNS resolution failed").
_NO_CONNECTION = ("failed to connect to all addresses", "errors resolving", "dns resolution failed")


def unreachable_reason(code: grpc.StatusCode, details: str) -> str | None:
    """Why no server was reached, in a few words, for an UNAVAILABLE that gRPC itself gave
    before any server answered (refused, unresolved, timed out, unreachable); None for any
    other error (a server's own UNAVAILABLE, "the server is shutting down", is a server's
    answer; a failed TLS handshake met a server)."""
    lowered = details.lower()
    if code != grpc.StatusCode.UNAVAILABLE or not lowered.startswith(_NO_CONNECTION):
        return None
    if "connection refused" in lowered:
        return "connection refused: nothing listens there"
    if lowered.startswith(("errors resolving", "dns resolution failed")):
        return "the name does not resolve"
    if "timeout" in lowered or "timed out" in lowered:
        return "the connection timed out"
    if "no route to host" in lowered or "network is unreachable" in lowered:
        return "the host is unreachable"
    # Anything else (a TLS handshake refused, a socket closed): a server may well be there, and
    # gRPC's own words say more than "cannot reach".
    return None


class TypedErrors:
    """`with TypedErrors(target):` around a call's I/O, blocking or awaited: a failed call's
    grpc.RpcError comes out as its TracewireError (the one place both clients map them),
    `Unreachable` when no server at `target` answered. Raised `from None`: the grpc error
    adds nothing the typed one does not say."""

    def __init__(self, target: str | None = None) -> None:
        self._target = target

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, grpc.RpcError):
            raise from_rpc_error(exc, self._target) from None


# Where gRPC carries a google.rpc.Status (serialized) next to the code and message.
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


def _trailers(error: grpc.RpcError) -> Iterable[tuple[str, str | bytes]]:
    """The (key, value) pairs of a failed call's trailing metadata: a grpc.Call's tuple,
    or grpc.aio's Metadata, which iterates as the same pairs. A bare RpcError has none."""
    read = getattr(error, "trailing_metadata", None)
    trailers: Iterable[tuple[str, str | bytes]] | None = read() if callable(read) else None
    return trailers or ()


def _rich_status(error: grpc.RpcError, code: grpc.StatusCode) -> status_pb2.Status | None:
    """The google.rpc.Status the server attached to this error, if any."""
    for key, value in _trailers(error):
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return None  # a garbled detail must not hide the error it came with
        # A proxy that rewrote the code left a detail describing some other failure.
        return status if status.code == code.value[0] else None
    return None


def _violated_field(status: status_pb2.Status | None) -> str | None:
    """The path of the first field a BadRequest detail names."""
    for detail in status.details if status is not None else ():
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request) and bad_request.field_violations:
            return str(bad_request.field_violations[0].field)
    return None
