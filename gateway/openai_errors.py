"""The OpenAI API's error objects: ``ApiError`` (an HTTP status and the OpenAI error body), and the
core's ``Abort`` as one (its gRPC status as an HTTP status and an OpenAI error type, its field as the
API's ``param``)."""

from __future__ import annotations

import math

from common.errors import Abort, Status

# OpenAI error type -> the gRPC statuses of that type, with their HTTP status (the mapping that
# google/rpc/code.proto gives for each code; CANCELLED is 499, "client closed request").
_ERROR_TYPES = {
    "invalid_request_error": {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404, "ABORTED": 409},
    "rate_limit_error": {"RESOURCE_EXHAUSTED": 429},
    "authentication_error": {"UNAUTHENTICATED": 401},
    "permission_error": {"PERMISSION_DENIED": 403},
    "service_unavailable_error": {"UNAVAILABLE": 503},
    "timeout_error": {"DEADLINE_EXCEEDED": 504},
    "cancelled_error": {"CANCELLED": 499},
    "server_error": {"DATA_LOSS": 500, "INTERNAL": 500, "UNKNOWN": 500},
}
# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {Status[code]: (http, kind) for kind, codes in _ERROR_TYPES.items() for code, http in codes.items()}
# The gRPC request's field names (``Abort.field``) as this API names them; None: no field of its own.
_PARAM = {
    "max_new_tokens": "max_tokens",
    "chat": "messages",
    "chat.messages": "messages",
    "chat.messages.role": "messages",
    "text": "prompt",
    "prompt_ids": "prompt",
    "speculation.mode": "speculation",
    "speculation.budget": "speculation",
    "stop_ids": None,
    "system": None,
    "input": None,
}
_CODE = {Status.UNAUTHENTICATED: "invalid_api_key", Status.NOT_FOUND: "not_found"}


class ApiError(Exception):
    """An error this API answers with: its HTTP status and the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        # Retry-After in whole seconds (RFC 9110); the openai clients honour it on a 429
        self.headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after is not None else {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def from_abort(e: Abort) -> ApiError:
    status, type_ = HTTP_STATUS.get(e.code, (500, "server_error"))
    param = _PARAM.get(e.field, e.field)
    return ApiError(status, e.message, type_, param, _CODE.get(e.code, e.code.name.lower()), e.retry_after)


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model {model!r} does not exist; this server serves {served!r} (GET /v1/models)",
        "invalid_request_error",
        "model",
        "model_not_found",
    )
