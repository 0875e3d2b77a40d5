"""Errors raised where a problem is detected, mapped to gRPC status in one place.

Code below the gRPC layer raises these; `servicer.py` turns them into a status
(with a google.rpc.BadRequest detail naming the field for invalid arguments).
Nothing else in the server builds a status by hand.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2


class TracewireError(Exception):
    """Base of every error that becomes a gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(TracewireError):
    """The request is malformed; `field` is the path of the offending field."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.description = message


class ResourceExhausted(TracewireError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(TracewireError):
    """No valid bearer token (--auth-tokens)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(TracewireError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(TracewireError):
    code = grpc.StatusCode.UNAVAILABLE


class Internal(TracewireError):
    code = grpc.StatusCode.INTERNAL


class AlreadyExists(TracewireError):
    """A name is taken (a dictionary registered without `replace`)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(TracewireError):
    """The caller may not change this (another tenant's or the operator's dictionary)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(TracewireError):
    code = grpc.StatusCode.NOT_FOUND


# A status travels in trailers, which clients cap (grpc's hard limit is 16 KiB): a message
# that quotes a large input (a 100 kB `model`) would turn into the client's own
# RESOURCE_EXHAUSTED. Messages and field paths are clipped to these many characters.
MAX_MESSAGE_CHARS = 1024
MAX_FIELD_CHARS = 256


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def to_rpc_status(error: TracewireError) -> status_pb2.Status:
    """The rich google.rpc.Status for an error (details: BadRequest for fields)."""
    status = status_pb2.Status(code=_CODE_VALUES[error.code], message=_clip(error.message, MAX_MESSAGE_CHARS))
    if isinstance(error, InvalidArgument) and error.field:
        detail = any_pb2.Any()
        detail.Pack(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=_clip(error.field, MAX_FIELD_CHARS),
                        description=_clip(error.description, MAX_MESSAGE_CHARS),
                    )
                ]
            )
        )
        status.details.append(detail)
    return status


_CODE_VALUES = {
    grpc.StatusCode.INVALID_ARGUMENT: code_pb2.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: code_pb2.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED: code_pb2.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION: code_pb2.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE: code_pb2.UNAVAILABLE,
    grpc.StatusCode.INTERNAL: code_pb2.INTERNAL,
    grpc.StatusCode.ALREADY_EXISTS: code_pb2.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED: code_pb2.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND: code_pb2.NOT_FOUND,
}
