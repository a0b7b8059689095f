"""An OpenAI request body as the gateway's plain values: a ``Call``, which holds the gateway's ``Request``.

No HTTP here (``openai_http`` is the transport); this module is what an OpenAI request means in terms
of the gateway's ``Request``:

* ``/v1/chat/completions`` takes ``messages`` (chat template), ``/v1/completions`` a ``prompt``
  (plain text, no template, or token ids). ``max_tokens`` / ``max_completion_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``stop`` and ``n`` (1 only) as OpenAI defines them, except
  that an absent ``temperature`` is greedy (this service's default: output token for token what the
  model alone produces); a stop string ends the text and is not part of it.
* ``tools`` and ``tool_choice`` go into the chat template and choose how calls are read from the
  text; a required or named call, and ``response_format``, constrain the output with a grammar.
* Extensions: ``session_id`` ("new": a session that is kept; an id: its next turn, whose
  ``messages`` or ``prompt`` are only this turn's; absent: a session closed after the call),
  ``top_k``, ``speculation`` (``{"mode", "budget"}``), ``return_token_ids``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from pydantic import ValidationError

from . import tools as T
from .grammar import GrammarSpec
from .openai_bodies import ChatBody, CompletionBody, NamedToolChoice, ResponseFormat, Speculation
from .openai_errors import ApiError, bad_request
from .requests import Request

NEW_SESSION = "new"


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
    grammar = _response_grammar(b.response_format)
    inputs = _input(b, chat)
    tools_json, parser, tool_grammar = _tools(b, tool_parser) if chat else ("", "", None)
    logprobs = _logprobs(b, chat)
    request = Request(
        session_id="" if sid == NEW_SESSION else sid,
        **inputs,
        **_sampling(b),
        stop=stop,
        keep=bool(sid),
        tools=tools_json,
        grammar=tool_grammar or grammar,
        logprobs=logprobs,
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


def _input(b: ChatBody | CompletionBody, chat: bool) -> dict:
    """The ``Request``'s input fields: the chat's messages (and the keys they carry beyond role and
    content), the prompt's text or its token ids."""
    if chat:
        messages = tuple(m.pair() for m in b.messages)
        extra = tuple(m.extra() for m in b.messages)
        return dict(input="chat", prompt="", prompt_ids=(), chat=messages, chat_extra=extra if any(extra) else ())
    if isinstance(b.prompt, str):
        return dict(input="text", prompt=b.prompt, prompt_ids=(), chat=(), chat_extra=())
    return dict(input="prompt_ids", prompt="", prompt_ids=tuple(b.prompt), chat=(), chat_extra=())


def sampling_fields(b, max_new_tokens: int) -> dict:
    """The ``Request``'s fields of how tokens are chosen and drafted, and whether the turn is shared,
    from the fields every OpenAI body here has alike (``temperature``, ``top_p``, ``top_k``, ``seed``,
    ``share``, ``speculation``)."""
    spec = b.speculation or Speculation()
    return dict(
        max_new_tokens=max_new_tokens,
        mode=spec.mode,
        budget=spec.budget,
        forced=spec.forced,
        temperature=b.temperature or 0.0,
        top_p=b.top_p or 0.0,
        top_k=max(b.top_k or 0, 0),
        seed=b.seed,
        share=b.share is not False,
    )


def _sampling(b: ChatBody | CompletionBody) -> dict:
    """``sampling_fields``, and the logit bias and penalties chat and completions take."""
    return sampling_fields(b, b.max_completion_tokens or b.max_tokens or 0) | dict(
        logit_bias=tuple((int(k), float(v)) for k, v in (b.logit_bias or {}).items()),
        presence_penalty=float(b.presence_penalty or 0.0),
        frequency_penalty=float(b.frequency_penalty or 0.0),
    )


def _logprobs(b: ChatBody | CompletionBody, chat: bool) -> int:
    """-1: no log-probabilities; else the alternatives per token (chat: ``top_logprobs``, which
    needs ``logprobs: true``; completions: ``logprobs``)."""
    if not chat:
        return -1 if b.logprobs is None else b.logprobs
    if b.logprobs:
        return b.top_logprobs or 0
    if b.top_logprobs:
        raise bad_request("top_logprobs: requires logprobs: true", "top_logprobs")
    return -1


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
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    told, grammar = tool_grammar(tools, choice if isinstance(choice, str) else None, name, parser)
    return (json.dumps(tools, ensure_ascii=False), parser, grammar) if told else ("", "", None)


def tool_grammar(
    tools: list[dict], choice: str | None, name: str | None, parser: str
) -> tuple[bool, GrammarSpec | None]:
    """For ``tools`` in chat's shape and a ``tool_choice`` (``choice``: none, auto, required or None;
    ``name``: the function it names): whether the model is told of the tools (not with ``none``:
    then its text is not read for calls either), and the grammar that forces a required or named
    call (None: the model chooses). 400 for two tools of one name, a name no tool has, or a forced
    call with a parser other than hermes (the grammar writes hermes' call format)."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two tools have the same name", "tools")
    if choice == "none":
        return False, None
    if choice != "required" and name is None:
        return True, None
    if name is not None and name not in names:
        raise bad_request(f"tool_choice: no tool is named {name!r}", "tool_choice")
    if parser != "hermes":
        raise bad_request(
            f"tool_choice: a required or named call needs the hermes tool-call parser (this server reads "
            f"calls with {parser!r})",
            "tool_choice",
        )
    return True, GrammarSpec("tool_call", json.dumps(T.call_schema(tools, name), sort_keys=True), "tools")
