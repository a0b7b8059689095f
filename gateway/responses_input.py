"""A Responses request body as the gateway's plain values: its input items as chat messages (what the
chat template renders), its tools and output format as chat's (the same template and grammar path),
and the checks a conversation makes of its items.

* ``input``: a string (one user message) or items. A ``message`` of role user, system, developer
  (system) or assistant; a ``function_call`` joins the assistant message before it (else makes one)
  as one of its ``tool_calls``; a ``function_call_output`` is a ``tool`` message.
* A ``function_call_output`` must answer a call of the conversation (made in this input or by an
  earlier response of the chain) that no output answered yet.
* With ``previous_response_id`` the input holds only what is new: an item of the conversation sent
  again (an output item's id, a call id the conversation holds) is a 400, not a second copy.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from pydantic import ValidationError

from .grammar import GrammarSpec
from .openai_bodies import _args, _FunctionCall, _ToolCall
from .openai_errors import bad_request
from .openai_requests import _invalid, tool_grammar
from .responses_bodies import ITEMS, FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponsesBody

KEEP_IDS = 1024  # ids of a conversation's items kept for the checks (the most recent)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def parse_body(body) -> ResponsesBody:
    try:
        return ResponsesBody.model_validate(body)
    except ValidationError as e:
        raise _invalid(e) from None


@dataclass
class Conversation:
    """What the conversation before this input holds: its calls (call id -> answered) and the ids of
    its items (output items, and input items that came with an id)."""

    calls: dict[str, bool] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)

    def then(self, ids: list[str], calls: dict[str, bool]) -> Conversation:
        """The conversation with more items and calls (bounded: the most recent are kept)."""
        merged = {**self.calls, **calls}
        return Conversation(dict(list(merged.items())[-KEEP_IDS:]), (self.ids + ids)[-KEEP_IDS:])


@dataclass
class Input:
    """The input as chat messages, as the items to store (each with an id), and the conversation after it."""

    messages: list[dict]
    items: list[dict]
    after: Conversation


def _item(raw: dict, i: int):
    kind = raw.get("type", "message" if "role" in raw else None)
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(
            f"input[{i}].type: {kind!r} is not an input item this server takes ({', '.join(ITEMS)})",
            "input",
            "invalid_value",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = _invalid(e).body["error"]
        raise bad_request(f"input[{i}].{err['message']}", "input") from None


def read_input(b: ResponsesBody, before: Conversation, continued: bool) -> Input:
    """The body's input checked against the conversation ``before`` it (``continued``: a
    ``previous_response_id`` holds the rest of it)."""
    raw = [{"type": "message", "role": "user", "content": b.input}] if isinstance(b.input, str) else b.input
    calls = dict(before.calls)
    known = set(before.ids)
    messages: list[dict] = []
    items: list[dict] = []
    for i, r in enumerate(raw):
        it = _item(r, i)
        if continued and it.id is not None and it.id in known:
            raise bad_request(
                f"input[{i}]: item {it.id!r} is already in the conversation of previous_response_id; "
                "send only the new items",
                "input",
            )
        if isinstance(it, MessageItem):
            _message(it, messages)
        elif isinstance(it, FunctionCallItem):
            if it.call_id in calls:
                raise bad_request(f"input[{i}]: call_id {it.call_id!r} is already a call of this conversation", "input")
            calls[it.call_id] = False
            _call(it, messages)
        else:
            _answer(it, i, calls, messages)
        items.append(_stored(it))
    ids = [x["id"] for x in items if x.get("id")]
    return Input(messages, items, before.then(ids, calls))


def _message(it: MessageItem, messages: list[dict]) -> None:
    role = "system" if it.role == "developer" else it.role
    messages.append({"role": role, "content": it.text()})


def _call(it: FunctionCallItem, messages: list[dict]) -> None:
    """The call joins the assistant message just before it (one turn's calls), else opens one."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    call = _ToolCall(id=it.call_id, function=_FunctionCall(name=it.name, arguments=it.arguments))
    entry = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": _args(call)}}
    last.setdefault("tool_calls", []).append(entry)


def _answer(it: FunctionCallOutputItem, i: int, calls: dict[str, bool], messages: list[dict]) -> None:
    answered = calls.get(it.call_id)
    if answered is None:
        raise bad_request(f"input[{i}]: call_id {it.call_id!r}: no function call of this conversation has it", "input")
    if answered:
        raise bad_request(f"input[{i}]: call_id {it.call_id!r}: that call was already answered", "input")
    calls[it.call_id] = True
    messages.append({"role": "tool", "content": it.text(), "tool_call_id": it.call_id})


def _stored(it) -> dict:
    """The item as ``GET /v1/responses/{id}/input_items`` lists it."""
    if isinstance(it, MessageItem):
        kind = "output_text" if it.role == "assistant" else "input_text"
        parts = (
            [{"type": kind, "text": it.content}]
            if isinstance(it.content, str)
            else [p.model_dump() for p in it.content]
        )
        return {
            "id": it.id or new_id("msg"),
            "type": "message",
            "role": it.role,
            "status": "completed",
            "content": parts,
        }
    out = it.model_dump(exclude_none=True)
    out.setdefault("id", new_id("fc" if isinstance(it, FunctionCallItem) else "fco"))
    return out | {"status": "completed"}


def chat_fields(messages: list[dict]) -> dict:
    """The ``Request``'s chat fields: (role, content) pairs and each message's other keys as JSON."""
    pairs = tuple((m["role"], m["content"]) for m in messages)
    extra = tuple(json.dumps({k: v for k, v in m.items() if k not in ("role", "content")}) if len(m) > 2 else ""
                  for m in messages)  # fmt: skip
    return dict(input="chat", prompt="", prompt_ids=(), chat=pairs, chat_extra=extra if any(extra) else ())


@dataclass(frozen=True)
class Shape:
    """What the tools and the text format make of the turn: the tools for the template (JSON, ""
    none), the parser its text is read with ("" none), the grammar of its output (None: free)."""

    tools: str
    parser: str
    grammar: GrammarSpec | None
    parallel: bool


def shape(b: ResponsesBody, parser: str) -> Shape:
    tools = [t.chat() for t in b.tools or ()]
    choice = b.tool_choice
    parallel = b.parallel_tool_calls is not False
    text = _text_grammar(b)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: requires tools", "tool_choice")
        return Shape("", "", text, parallel)
    name = None if isinstance(choice, (str, type(None))) else choice.name
    told, grammar = tool_grammar(tools, choice if isinstance(choice, str) else None, name, parser)
    if not told:
        return Shape("", "", text, parallel)
    return Shape(json.dumps(tools, ensure_ascii=False), parser, grammar or text, parallel)


def _text_grammar(b: ResponsesBody) -> GrammarSpec | None:
    f = b.format
    if f.type == "text":
        return None
    if f.type == "json_object":
        return GrammarSpec("json_object", field="text.format")
    return GrammarSpec("json_schema", json.dumps(f.schema_, sort_keys=True), "text.format")
