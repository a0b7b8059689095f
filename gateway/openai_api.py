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

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from common.errors import Abort, Status

from . import tools as T
from .grammar import GrammarSpec
from .links import LogProbs
from .requests import Request
from .stops import StopText
from .turn import Finished

NEW_SESSION = "new"

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


# -- requests -----------------------------------------------------------------------------------
# Strict types: JSON's true is not 1, 1.0 is not an integer and a number is not a string. None (JSON
# null) is the field left out. Unknown fields are ignored (kept aside only to refuse the ones this
# server does not implement, ``_NO_OP``).


def _one_error(message: str):
    """A union's errors (one per branch) as one error that says what the field takes."""

    def wrap(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid", message) from None

    return WrapValidator(wrap)


def _only(message: str, ok):
    """A value that passes its type but not ``ok``: one error with ``message``."""

    def check(value):
        if not ok(value):
            raise PydanticCustomError("invalid", message)
        return value

    return AfterValidator(check)


def _single_prompt(value):
    """A one-item array of prompts is that prompt (one prompt per call)."""
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)) else value


TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**31)]
Count = Annotated[int, Field(strict=True, ge=1)]
Prompt = Annotated[
    StrictStr | Annotated[list[TokenId], Field(min_length=1)],
    _one_error("expected a string or an array of token ids >= 0 (one prompt per call)"),
    BeforeValidator(_single_prompt),
]


class _Part(BaseModel):
    type: Literal["text"]
    text: StrictStr


class _FunctionCall(BaseModel):
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr  # JSON text of an object, as the API returned it


class _ToolCall(BaseModel):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[StrictStr | list[_Part], _one_error("expected a string or an array of text parts")] | None = None
    tool_calls: list[_ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool's answer: to which call
    name: StrictStr | None = None

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing", "content: Field required")
        return self

    def pair(self) -> tuple[str, str]:
        """(role, text): developer is system, parts are joined."""
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return ("system" if self.role == "developer" else self.role), text

    def extra(self) -> str:
        """The keys the chat template reads beyond role and content, as JSON ("" none)."""
        out: dict = {}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return json.dumps(out, ensure_ascii=False) if out else ""


def _args(c: _ToolCall):
    """A call's arguments as the object templates render (its JSON text when it is not one)."""
    try:
        value = json.loads(c.function.arguments)
    except ValueError:
        return c.function.arguments
    return value if isinstance(value, dict) else c.function.arguments


class _Function(BaseModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: _Function


class _Named(BaseModel):
    class _Name(BaseModel):
        name: StrictStr

    type: Literal["function"]
    function: _Name


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | _Named,
    _one_error('expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'),
]


class Speculation(BaseModel):
    mode: StrictStr = ""  # "": racer
    budget: StrictInt = 0  # 0: adaptive
    forced: StrictBool = True  # the tokens a grammar forces are drafted as a path of their own


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _JsonSchema(BaseModel):
    name: StrictStr = "response"
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", 'json_schema: required with type "json_schema"')
        return self


# Fields this server does not implement, with the values that ask for nothing (refused otherwise).
_NO_OP = {
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "best_of": (1,),
}


class _Body(BaseModel):
    """What both endpoints read."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: Annotated[StrictStr, Field(min_length=1)]
    n: Annotated[StrictInt, _only("only 1 is supported", lambda n: n == 1)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_completion_tokens: Count | None = None  # wins over max_tokens
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(strict=True, ge=-(2**63), lt=2**63)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1, lt=2**31)] | None = None  # -1: off, as vLLM spells it
    stop: Annotated[StrictStr | list[StrictStr], _one_error("expected a string or an array of strings")] | None = None
    speculation: Speculation | None = None
    session_id: StrictStr | None = None
    return_token_ids: StrictBool | None = None
    share: StrictBool | None = None  # False: the turn stays out of the tenant corpus
    response_format: ResponseFormat | None = None
    presence_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(strict=True, ge=-100, le=100)]]
        | None
    ) = None

    @model_validator(mode="after")
    def _no_ops(self):
        for name, ok in _NO_OP.items():
            v = (self.model_extra or {}).get(name)
            if v is not None and v not in ok:
                raise PydanticCustomError(
                    "unsupported_parameter", "{name}: not supported by this server", {"name": name}
                )
        return self


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None


class CompletionBody(_Body):
    prompt: Prompt
    echo: StrictBool | None = None  # the prompt before the completion (with its log-probabilities)
    logprobs: Annotated[int, Field(strict=True, ge=0, le=5)] | None = None


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
    tool_parser: str = ""  # how tool calls are read from the text ("": they are not: plain content)
    parallel_tool_calls: bool = True  # False: the first call only
    logprobs: int = -1  # -1: none; else top_logprobs (chat) or logprobs (completions)
    echo: bool = False  # completions: the prompt before the completion
    id: str = field(default_factory=lambda: secrets.token_hex(12))  # after "chatcmpl-" or "cmpl-"
    created: int = field(default_factory=lambda: int(time.time()))


def _invalid(e: ValidationError) -> ApiError:
    """The first error, naming its field as OpenAI does (``messages[0].content``); ``param`` is the
    top-level field."""
    err = e.errors(include_url=False)[0]
    loc = err["loc"]
    if err["type"] == "unsupported_parameter":
        name = err["ctx"]["name"]
        return bad_request(f"{name}: not supported by this server", name, "unsupported_parameter")
    if not loc:
        return bad_request("the request body must be a JSON object")
    where = str(loc[0]) + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in loc[1:])
    got = "" if err["type"] == "missing" else f", got {_short(err['input'])}"
    return bad_request(f"{where}: {err['msg']}{got}", str(loc[0]))


def _short(v) -> str:
    """A value as the caller sent it, cut to 32 characters (a number may have thousands of digits)."""
    text = repr(v)
    return text if len(text) <= 32 else f"{text[:29]}..."


def parse(body, chat: bool, session_header: str = "", tool_parser: str = "hermes") -> Call:
    """A request body (parsed JSON) as a ``Call``; ``ApiError`` 400 for what is malformed here
    (the gateway's own checks, limits included, come later as ``Abort``). ``tool_parser``: the
    server's (``gateway.tools.PARSERS``)."""
    try:
        b = (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as e:
        raise _invalid(e) from None
    sid = b.session_id or session_header
    stop = (b.stop,) if isinstance(b.stop, str) else tuple(b.stop or ())
    spec = b.speculation or Speculation()
    extra: tuple[str, ...] = ()
    tools_json, parser, grammar = "", "", _response_grammar(b.response_format)
    logprobs = -1
    if chat:
        kind, text, ids, messages = "chat", "", (), tuple(m.pair() for m in b.messages)
        extra = tuple(m.extra() for m in b.messages)
        if not any(extra):
            extra = ()
        tools_json, parser, tool_grammar = _tools(b, tool_parser)
        grammar = tool_grammar or grammar
        if b.logprobs:
            logprobs = b.top_logprobs or 0
        elif b.top_logprobs:
            raise bad_request("top_logprobs: requires logprobs: true", "top_logprobs")
    elif isinstance(b.prompt, str):
        kind, text, ids, messages = "text", b.prompt, (), ()
    else:
        kind, text, ids, messages = "prompt_ids", "", tuple(b.prompt), ()
    if not chat and b.logprobs is not None:
        logprobs = b.logprobs
    request = Request(
        session_id="" if sid == NEW_SESSION else sid,
        input=kind,
        prompt=text,
        chat=messages,
        prompt_ids=ids,
        max_new_tokens=b.max_completion_tokens or b.max_tokens or 0,
        mode=spec.mode,
        budget=spec.budget,
        temperature=b.temperature or 0.0,
        top_p=b.top_p or 0.0,
        top_k=max(b.top_k or 0, 0),
        seed=b.seed,
        stop=stop,
        share=b.share is not False,
        keep=bool(sid),
        chat_extra=extra,
        tools=tools_json,
        grammar=grammar,
        logprobs=logprobs,
        forced=spec.forced,
        logit_bias=tuple((int(k), float(v)) for k, v in (b.logit_bias or {}).items()),
        presence_penalty=float(b.presence_penalty or 0.0),
        frequency_penalty=float(b.frequency_penalty or 0.0),
        echo=not chat and bool(b.echo),
    )
    include_usage = b.stream_options is not None and b.stream_options.include_usage
    parallel = not chat or b.parallel_tool_calls is not False
    return Call(
        request,
        chat,
        b.model,
        bool(b.stream),
        include_usage,
        bool(sid),
        bool(b.return_token_ids),
        stop,
        parser,
        parallel,
        logprobs,
        not chat and bool(b.echo),
    )


def _response_grammar(rf: ResponseFormat | None) -> GrammarSpec | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_object")
    schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True), "response_format")


def _tools(b: ChatBody, parser: str) -> tuple[str, str, GrammarSpec | None]:
    """(tools as JSON for the template, the parser to read calls with ("": none), the grammar of a
    required or named call)."""
    choice = b.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in b.tools or ()]
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: requires tools", "tool_choice")
        return "", "", None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two tools have the same name", "tools")
    if choice == "none":  # the model is told of no tools and its text is not read for calls
        return "", "", None
    grammar = None
    if choice == "required" or isinstance(choice, _Named):
        name = choice.function.name if isinstance(choice, _Named) else None
        if name is not None and name not in names:
            raise bad_request(f"tool_choice: no tool is named {name!r}", "tool_choice")
        if parser != "hermes":
            raise bad_request(
                f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} needs the hermes "
                f"tool-call parser (this server reads calls with {parser!r})",
                "tool_choice",
            )
        schema = T.call_schema(tools, name)
        grammar = GrammarSpec("tool_call", json.dumps(schema, sort_keys=True), "tools")
    return json.dumps(tools, ensure_ascii=False), parser, grammar


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


def response(
    call: Call, f: Finished, text: str, reason: str, token_ids: list[int], logprobs: dict | None = None
) -> dict:
    """The whole answer of a call without ``stream`` (``logprobs``: the choice's, made by ``Tokens``)."""
    if call.chat:
        message: dict = {"role": "assistant", "content": text}
        parsed = T.parse(call.tool_parser, text) if call.tool_parser else None
        if parsed is not None and parsed[1]:
            content, calls = parsed
            calls = calls if call.parallel_tool_calls else calls[:1]
            message = {"role": "assistant", "content": content or None, "tool_calls": [c.openai() for c in calls]}
            if reason == "stop":
                reason = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": logprobs}
        out = _head(call, "chat.completion", f.session_id)
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs}
        out = _head(call, "text_completion", f.session_id)
    choice["finish_reason"] = reason
    if call.return_token_ids:
        choice["token_ids"] = token_ids
    out.update(choices=[choice], usage=usage(f), speculation=_stats(f))
    return out


def chunk(
    call: Call,
    session_id: str,
    text: str | None,
    token_ids: list[int],
    reason: str | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One streamed event: a text delta (chat: ``text`` None is the opening delta with the role)."""
    if call.chat:
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        out = _head(call, "chat.completion.chunk", session_id)
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        out = _head(call, "text_completion", session_id)
    if call.return_token_ids and text is not None:
        choice["token_ids"] = token_ids
    out["choices"] = [choice]
    return out


def tool_call_chunks(call: Call, session_id: str, index: int, tc: T.ToolCall, piece: int = 32) -> list[dict]:
    """A call as streamed deltas: the first with its index, id, type and name (arguments ""), then
    its arguments in fragments of ``piece`` characters."""
    first = {"index": index, "id": T.new_call_id(), "type": "function", "function": {"name": tc.name, "arguments": ""}}
    deltas = [first] + [
        {"index": index, "function": {"arguments": tc.arguments[i : i + piece]}}
        for i in range(0, len(tc.arguments), piece)
    ]
    out = []
    for d in deltas:
        ev = _head(call, "chat.completion.chunk", session_id)
        ev["choices"] = [{"index": 0, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}]
        out.append(ev)
    return out


class Tokens:
    """Log-probabilities as OpenAI returns them, from the verifier's (chat: ``content`` entries;
    completions: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

    def __init__(self, call: Call, tokenizer):
        self.call = call
        self.tokenizer = tokenizer
        self.offset = 0  # completions: characters before the next token

    def _text(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer is not None else ""

    def echo(self, ids: list[int], lp: LogProbs | None) -> tuple[str, dict | None]:
        """The echoed prompt: its text, and its tokens' entries (the first one's log-probability is None)."""
        r = self.call.request
        text = r.prompt if r.input == "text" else (self.tokenizer.decode(ids) if self.tokenizer is not None else "")
        return text, self.entries(ids, lp)

    def entries(self, ids: list[int], lp: LogProbs | None) -> dict | None:
        if lp is None or self.call.logprobs < 0:
            return None
        if self.call.chat:
            content = []
            for t, v, top_ids, top in zip(ids, lp.chosen, lp.top_ids, lp.top):
                text = self._text(t)
                content.append(
                    {
                        "token": text,
                        "logprob": v,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {"token": (s := self._text(i)), "logprob": w, "bytes": list(s.encode())}
                            for i, w in zip(top_ids, top)
                        ],
                    }
                )
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, v, top_ids, top in zip(ids, lp.chosen, lp.top_ids, lp.top):
            text = self._text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(v)
            out["top_logprobs"].append(None if v is None else {self._text(i): w for i, w in zip(top_ids, top)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    @staticmethod
    def join(parts: list[dict]) -> dict | None:
        if not parts:
            return None
        out = {k: [] for k in parts[0]}
        for p in parts:
            for k, v in p.items():
                out[k].extend(v)
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
