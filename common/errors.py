"""Errors a service's core raises to end a call, with the status the caller gets.

The cores never import grpc: they raise ``Abort(Status.X, message)``, and the servers' one
interceptor (``common.server.ErrorInterceptor``) turns it into the gRPC status of the same name.
A message names the field or the limit at fault, so that the caller can fix the request; ``field``
names it for transports that say so apart from the message (the OpenAI error object's ``param``).
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """The gRPC status codes the services answer with (same names as ``grpc.StatusCode``)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    NOT_FOUND = "NOT_FOUND"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    DATA_LOSS = "DATA_LOSS"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"


# The first word of the UNAVAILABLE a drafter or verifier answers while it shuts down: the caller
# moves the session to another replica (nothing failed), and does not count it as a lost stream.
DRAINING = "draining"


class Abort(Exception):
    """Ends the call with ``code`` and ``message``; ``retry_after``: seconds after which a retry may
    succeed (an HTTP ``Retry-After``; on gRPC, trailing metadata and a ``google.rpc.RetryInfo`` detail);
    ``field``: the request field at fault, as the gRPC request names it (``speculation.mode``)."""

    def __init__(self, code: Status, message: str, retry_after: float | None = None, field: str | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message
        self.retry_after = retry_after
        self.field = field


class FieldError(ValueError):
    """A value outside its field's range: a ``ValueError`` that names the field it is about."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def invalid(field: str, message: str) -> Abort:
    """``INVALID_ARGUMENT`` about ``field``: the message starts with the field's name."""
    return Abort(Status.INVALID_ARGUMENT, f"{field}: {message}", field=field)


def check(cond: bool, code: Status, message: str) -> None:
    """``Abort(code, message)`` unless ``cond``."""
    if not cond:
        raise Abort(code, message)


def draining(kind: str) -> Abort:
    """What a backend shutting down answers to a request it will not serve."""
    return Abort(Status.UNAVAILABLE, f"{DRAINING}: this {kind} is shutting down; continue on another one")
