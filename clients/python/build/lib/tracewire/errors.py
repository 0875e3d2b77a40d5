"""Typed exceptions, one per gRPC status code the service uses.

Every RPC error surfaces as a subclass of TracewireError; InvalidArgument also
carries the path of the offending request field (from the status's
google.rpc.BadRequest detail).
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


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


class DeadlineExceeded(TracewireError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(TracewireError):
    code = grpc.StatusCode.CANCELLED


class Unimplemented(TracewireError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(TracewireError):
    code = grpc.StatusCode.INTERNAL


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
    )
}


def from_rpc_error(error: grpc.RpcError) -> TracewireError:
    """The typed exception for a failed call."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    field = None
    status = rpc_status.from_call(error) if isinstance(error, grpc.Call) else None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                if bad_request.field_violations:
                    field = bad_request.field_violations[0].field
    cls = _BY_CODE.get(code, TracewireError)
    result = cls(message or str(code), field=field)
    result.code = code
    return result
