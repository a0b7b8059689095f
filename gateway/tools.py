"""Tools: how they reach the model (its chat template, or one the server ships) and how tool calls
are read back out of its text (a parser per output convention), whole or while streaming.

Parsers (``--tool-call-parser``):

* ``hermes``: each call is a JSON object ``{"name": ..., "arguments": {...}}`` between
  ``<tool_call>`` and ``</tool_call>`` (Hermes, Qwen 2.5 and 3, the shipped template).
* ``pythonic``: the whole answer is a Python list of calls with keyword arguments,
  ``[get_weather(city="Paris"), ...]`` (Llama 3.2 and 4).

A call that does not parse is no call: the text goes back as the message's content, never an error.
"""

from __future__ import annotations

import ast
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from common.errors import Abort, Status
from common.text import has_chat_template

PARSERS = ("hermes", "pythonic")
SHIPPED_TEMPLATE = Path(__file__).with_name("templates") / "hermes_tools.jinja"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object

    def openai(self, index: int | None = None) -> dict:
        out = {"id": new_call_id(), "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def load_template(path: str) -> str:
    """An operator's template file (``--chat-template``): its text ("" : none)."""
    return Path(path).read_text() if path else ""


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` (a template that never names them drops them)."""
    return bool(template) and "tools" in template


# What a chat request to a model without a chat template (and none from the operator) is answered.
NO_CHAT_TEMPLATE = (
    "this model has no chat template, so it serves completions (POST /v1/completions, or prompt_ids over "
    "gRPC), not chat; to serve chat, give it one with --chat-template FILE (RACER_CHAT_TEMPLATE)"
)


def template_for(tokenizer, operator: str, wants_tools: bool, field: str = "chat") -> str | None:
    """The template a chat request goes through: the operator's, else the model's own, except that
    a request with tools or tool-call history goes through the shipped one when the model's own
    cannot render tools. None: the tokenizer's own. A model without a template of its own (a base
    model) serves no chat without the operator's: INVALID_ARGUMENT about ``field``."""
    if operator:
        return operator
    if tokenizer is not None and not has_chat_template(tokenizer):
        raise Abort(Status.INVALID_ARGUMENT, NO_CHAT_TEMPLATE, field=field)
    if wants_tools and not supports_tools(getattr(tokenizer, "chat_template", None)):
        return SHIPPED_TEMPLATE.read_text()
    return None


# -- parsers --------------------------------------------------------------------------------------


def _call(obj) -> ToolCall | None:
    """A parsed hermes call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes_call(inner: str) -> ToolCall | None:
    try:
        return _call(json.loads(inner))
    except (ValueError, RecursionError):
        return None


def parse_hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    """(content outside the calls, calls), or None when the text holds no well-formed call."""
    if _OPEN not in text:
        return None
    calls, content, pos = [], [], 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(_CLOSE, start)
        if end < 0:
            return None
        call = parse_hermes_call(text[start + len(_OPEN) : end])
        if call is None:
            return None
        content.append(text[pos:start])
        calls.append(call)
        pos = end + len(_CLOSE)
    return "".join(content).strip(), calls


def parse_pythonic(text: str) -> tuple[str, list[ToolCall]] | None:
    """The whole text as a list of calls with literal keyword arguments, or None."""
    src = text.strip()
    if not src.startswith("["):
        return None
    try:
        tree = ast.parse(src, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(args) != len(node.keywords):
                return None
            arguments = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append(ToolCall(ast.unparse(node.func), arguments))
    return "", calls


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]] | None:
    return (parse_hermes if parser == "hermes" else parse_pythonic)(text)


# -- streaming ------------------------------------------------------------------------------------


class StreamParser:
    """Text in, as it is generated; out: content deltas and whole tool calls, in order.

    ``hermes``: content streams until a ``<tool_call>`` tag may begin (a possible tag's start is held
    back); a call is given once its closing tag arrives and it parses, else its text goes out as
    content. ``pythonic``: an answer that starts with ``[`` is held to its end, then parsed whole.
    """

    def __init__(self, parser: str):
        self.parser = parser
        self.buf = ""
        self.calls = 0
        self.started = False  # pythonic: the answer's first non-space character was seen
        self.held = False  # pythonic: the answer is a candidate list of calls

    def push(self, text: str) -> list[str | ToolCall]:
        self.buf += text
        return self._hermes(final=False) if self.parser == "hermes" else self._pythonic(final=False)

    def flush(self) -> list[str | ToolCall]:
        return self._hermes(final=True) if self.parser == "hermes" else self._pythonic(final=True)

    def _hermes(self, final: bool) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        while self.buf:
            start = self.buf.find(_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buf, _OPEN)
                text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                if text:
                    out.append(text)
                break
            if start:
                out.append(self.buf[:start])
                self.buf = self.buf[start:]
            end = self.buf.find(_CLOSE)
            if end < 0:
                if final:
                    out.append(self.buf)
                    self.buf = ""
                break
            whole = self.buf[: end + len(_CLOSE)]
            self.buf = self.buf[end + len(_CLOSE) :]
            call = parse_hermes_call(whole[len(_OPEN) : -len(_CLOSE)])
            out.append(call if call is not None else whole)
        return _merge(out)

    def _pythonic(self, final: bool) -> list[str | ToolCall]:
        if not self.started:
            stripped = self.buf.lstrip()
            if not stripped:
                return []
            self.started = True
            self.held = stripped.startswith("[")
        if not self.held:
            text, self.buf = self.buf, ""
            return [text] if text else []
        if not final:
            return []
        text, self.buf = self.buf, ""
        parsed = parse_pythonic(text)
        return [text] if parsed is None else list(parsed[1])


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _merge(items: list[str | ToolCall]) -> list[str | ToolCall]:
    out: list[str | ToolCall] = []
    for it in items:
        if isinstance(it, str) and out and isinstance(out[-1], str):
            out[-1] += it
        elif not (isinstance(it, str) and not it):
            out.append(it)
    return out


# -- tool_choice as a grammar ---------------------------------------------------------------------


def call_schema(tools: list[dict], name: str | None) -> dict:
    """The JSON schema of one call object: of the tool ``name``, or of any of ``tools``."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}
