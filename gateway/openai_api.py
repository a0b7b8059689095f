"""The OpenAI HTTP API's JSON as the gateway's plain values: requests in, responses, chunks and errors out.

No HTTP here (``openai_http`` is the transport); this module is what the OpenAI API means in terms of
the gateway's ``Request``, ``Chunk`` and ``Finished``:

* ``/v1/chat/completions`` takes ``messages`` (chat template), ``/v1/completions`` a ``prompt``
  (plain text, no template, or token ids). ``max_tokens`` / ``max_completion_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``stop`` and ``n`` (1 only) as OpenAI defines them, except
  that an absent ``temperature`` is greedy (this service's default: output token for token what the
  model alone produces); a stop string ends the text and is not part of it.
* Extensions: ``session_id`` ("new": a session that is kept; an id: its next turn, whose
  ``messages`` or ``prompt`` are only this turn's; absent: a session closed after the call),
  ``top_k``, ``speculation`` (``{"mode", "budget"}``), ``return_token_ids``. Responses carry
  ``session_id`` and ``speculation`` (the turn's rounds, drafted and accepted tokens, MAT, timings).
"""

from __future__ import annotations

import math
import re
import secrets
import time
from dataclasses import dataclass, field

from common.errors import Abort, Status

from .requests import Request
from .turn import Finished

NEW_SESSION = "new"

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Status.NOT_FOUND: (404, "invalid_request_error"),
    Status.ABORTED: (409, "invalid_request_error"),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Status.UNAUTHENTICATED: (401, "authentication_error"),
    Status.PERMISSION_DENIED: (403, "permission_error"),
    Status.UNAVAILABLE: (503, "service_unavailable_error"),
    Status.DEADLINE_EXCEEDED: (504, "timeout_error"),
    Status.CANCELLED: (499, "cancelled_error"),
    Status.DATA_LOSS: (500, "server_error"),
    Status.INTERNAL: (500, "server_error"),
    Status.UNKNOWN: (500, "server_error"),
}
# The gateway's field names (the first word of an Abort message) as this API names them.
_PARAM = {
    "max_new_tokens": "max_tokens",
    "chat.messages": "messages",
    "chat.messages.role": "messages",
    "prompt_ids": "prompt",
    "speculation.mode": "speculation",
    "speculation.budget": "speculation",
}
_PARAMS = {
    "max_tokens",
    "messages",
    "prompt",
    "speculation",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "session_id",
}
_CODE = {Status.UNAUTHENTICATED: "invalid_api_key", Status.NOT_FOUND: "not_found"}
ROLES = ("system", "user", "assistant")


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
    head = re.match(r"[a-z_.]*", e.message).group()
    param = _PARAM.get(head, head)
    param = param if param in _PARAMS else None
    return ApiError(status, e.message, type_, param, _CODE.get(e.code, e.code.name.lower()), e.retry_after)


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model {model!r} does not exist; this server serves {served!r} (GET /v1/models)",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


@dataclass(frozen=True)
class Call:
    """A checked OpenAI request: the gateway's request and what shapes the answer."""

    request: Request
    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage
    keep_session: bool  # False: the session is closed after the call
    return_token_ids: bool
    stop: tuple[str, ...] = ()
    id: str = field(default_factory=lambda: secrets.token_hex(12))  # after "chatcmpl-" or "cmpl-"
    created: int = field(default_factory=lambda: int(time.time()))


def _get(body: dict, name: str, kinds, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad_request(f"{name}: expected {_kind_names(kinds)}, got a boolean", name)
    if not isinstance(v, kinds):
        raise bad_request(f"{name}: expected {_kind_names(kinds)}, got {type(v).__name__}", name)
    return v


def _kind_names(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "an object",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = _get(body, name, (int, float))
    # compared, not converted: an integer too large for a float is out of range too (nan and
    # infinities compare false)
    if v is not None and not (lo <= v <= hi):
        raise bad_request(f"{name}: {_short(v)}, expected {lo}..{hi}", name)
    return v


def _short(v) -> str:
    """A number as the caller sent it, cut to 32 characters (it may have thousands of digits)."""
    text = repr(v)
    return text if len(text) <= 32 else f"{text[:29]}..."


def _unsupported(body: dict, **defaults) -> None:
    """Fields this server does not implement: refused unless absent or at their no-op value."""
    for name, ok in defaults.items():
        v = body.get(name)
        if v is not None and v != ok and not (isinstance(ok, tuple) and v in ok):
            raise bad_request(f"{name}: not supported by this server", name, "unsupported_parameter")


def _content(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content: expected a string or an array of text parts", "messages")


def _messages(body: dict) -> tuple[tuple[str, str], ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages: expected a non-empty array of {role, content}", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}]: expected an object", "messages")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise bad_request(
                f"messages[{i}].role: {role!r}, expected system, developer, user or assistant", "messages"
            )
        out.append((role, _content(i, m.get("content"))))
    return tuple(out)


def _prompt(body: dict) -> tuple[str, str, tuple[int, ...]]:
    """(input kind, text, ids) of a completions ``prompt``: a string, token ids, or a one-item array of either."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return "text", p, ()
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in p):
        return "prompt_ids", "", tuple(p)
    raise bad_request("prompt: expected a string or an array of token ids >= 0 (one prompt per call)", "prompt")


def parse(body, chat: bool, session_header: str = "") -> Call:
    """A request body (parsed JSON) as a ``Call``; ``ApiError`` 400 for what is malformed here
    (the gateway's own checks, limits included, come later as ``Abort``)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: required (GET /v1/models lists it)", "model")
    n = _get(body, "n", int, 1)
    if n != 1:
        raise bad_request(f"n: {n}, only 1 is supported", "n")
    _unsupported(
        body,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        logprobs=(False, 0),
        top_logprobs=0,
        tools=[],
        tool_choice="none",
        functions=[],
        function_call="none",
        echo=False,
        suffix="",
        best_of=1,
    )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")
    stream = bool(_get(body, "stream", bool, False))
    opts = _get(body, "stream_options", dict, {})
    include_usage = bool(opts.get("include_usage", False))
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens: {max_tokens}, expected a positive integer", "max_tokens")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0:
        raise bad_request("top_p: 0, expected a number in (0, 1]", "top_p")
    seed = _get(body, "seed", int)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad_request(f"seed: {seed}, expected a 64-bit signed integer", "seed")
    top_k = _get(body, "top_k", int, 0)
    if top_k == -1:  # "off", as vLLM spells it
        top_k = 0
    if not 0 <= top_k < 2**31:
        raise bad_request(f"top_k: {top_k}, expected 0 (off), -1 (off) or a positive 32-bit integer", "top_k")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is None:
        stop = ()
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop: expected a string or an array of strings", "stop")
    spec = _get(body, "speculation", dict, {})
    mode, budget = spec.get("mode", ""), spec.get("budget", 0)
    if not isinstance(mode, str) or not isinstance(budget, int) or isinstance(budget, bool):
        raise bad_request("speculation: expected {'mode': string, 'budget': integer}", "speculation")
    sid = _get(body, "session_id", str, "") or session_header
    keep = bool(sid)
    if sid == NEW_SESSION:
        sid = ""
    if chat:
        kind, text, ids, messages = "chat", "", (), _messages(body)
    else:
        (kind, text, ids), messages = _prompt(body), ()
    request = Request(
        session_id=sid,
        input=kind,
        prompt=text,
        chat=messages,
        prompt_ids=ids,
        max_new_tokens=max_tokens or 0,
        mode=mode,
        budget=budget,
        temperature=temperature or 0.0,
        top_p=top_p if top_p is not None else 0.0,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop),
        share=bool(_get(body, "share", bool, True)),
    )
    return Call(
        request,
        chat,
        model,
        stream,
        include_usage,
        keep,
        bool(_get(body, "return_token_ids", bool, False)),
        tuple(stop),
    )


class StopText:
    """The text OpenAI returns: up to, not including, the first stop string. While streaming, text
    that may be the start of a stop string is held back until the next tokens tell."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.longest = max(map(len, stops), default=0)
        self.text = ""
        self.sent = 0  # characters of ``text`` handed out
        self.hit = False  # a stop string ended the text

    def push(self, delta: str) -> str:
        if self.hit:
            return ""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        start = max(0, self.sent - self.longest)
        cuts = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if cuts:
            self.hit = True
            end = min(cuts)
        else:
            end = len(self.text) - self._held()
        out = self.text[self.sent : max(self.sent, end)]
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest end of ``text`` that begins a stop string."""
        t = self.text
        for n in range(min(self.longest - 1, len(t)), 0, -1):
            if any(s.startswith(t[-n:]) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """What was held back, at the end of a turn that no stop string ended."""
        if self.hit:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


def _stats(f: Finished) -> dict:
    s = f.stats
    return {
        "rounds": s.rounds,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "mat": round(s.mat, 4),
        "prefill_ms": round(f.prefill_ms, 3),
        "draft_ms": round(f.draft_ms, 3),
        "verify_ms": round(f.verify_ms, 3),
        "total_ms": round(f.total_ms, 3),
        "tokens_per_second": round(f.tokens_per_second, 3),
        "session_tokens": f.session_tokens,
    }


def usage(f: Finished) -> dict:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    }


def finish_reason(f: Finished, text: StopText) -> str:
    return "stop" if text.hit else f.finish_reason


def _head(call: Call, obj: str, session_id: str) -> dict:
    out = {"id": f"{'chatcmpl' if call.chat else 'cmpl'}-{call.id}", "object": obj, "created": call.created}
    out["model"] = call.model
    if call.keep_session:  # a one-call session is gone when the answer arrives: no id to continue
        out["session_id"] = session_id
    return out


def response(call: Call, f: Finished, text: str, reason: str, token_ids: list[int]) -> dict:
    """The whole answer of a call without ``stream``."""
    if call.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
        out = _head(call, "chat.completion", f.session_id)
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
        out = _head(call, "text_completion", f.session_id)
    choice["finish_reason"] = reason
    if call.return_token_ids:
        choice["token_ids"] = token_ids
    out.update(choices=[choice], usage=usage(f), speculation=_stats(f))
    return out


def chunk(call: Call, session_id: str, text: str | None, token_ids: list[int], reason: str | None = None) -> dict:
    """One streamed event: a text delta (chat: ``text`` None is the opening delta with the role)."""
    if call.chat:
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        out = _head(call, "chat.completion.chunk", session_id)
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        out = _head(call, "text_completion", session_id)
    if call.return_token_ids and text is not None:
        choice["token_ids"] = token_ids
    out["choices"] = [choice]
    return out


def last_chunk(call: Call, f: Finished, reason: str) -> dict:
    """The event with the finish reason, the speculation stats (and usage when asked for)."""
    out = chunk(call, f.session_id, "", [], reason)
    out["speculation"] = _stats(f)
    out["usage"] = None
    return out


def usage_chunk(call: Call, f: Finished) -> dict:
    """``stream_options.include_usage``: after the last choice, an event with no choices and the usage."""
    out = _head(call, "chat.completion.chunk" if call.chat else "text_completion", f.session_id)
    out.update(choices=[], usage=usage(f))
    return out


def models(name: str, created: int) -> dict:
    return {"object": "list", "data": [model(name, created)]}


def model(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "racer"}
