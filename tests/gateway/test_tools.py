"""Tool-call parsers: generated calls (arguments with quotes, nesting, unicode) written the way a
model writes them parse back to the same calls, whole or split anywhere while streaming; malformed
calls are text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import Abort, Status
from gateway.openai_errors import from_abort
from gateway.tools import (
    NO_CHAT_TEMPLATE,
    SHIPPED_TEMPLATE,
    StreamParser,
    ToolCall,
    call_schema,
    parse,
    parse_hermes,
    parse_pythonic,
    template_for,
)

NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
SCALAR = st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.text(max_size=12)
VALUE = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
ARGS = st.dictionaries(NAME, VALUE, max_size=4)
CALLS = st.lists(st.tuples(NAME, ARGS), min_size=1, max_size=3)
PROSE = st.text(st.characters(blacklist_characters="<["), max_size=20)


def _hermes(calls) -> str:
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
        for n, a in calls
    )


def _pythonic(calls) -> str:
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def _expected(calls) -> list[ToolCall]:
    return [ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]


def _streamed(parser: str, text: str, cuts: list[int]):
    p = StreamParser(parser)
    out = []
    last = 0
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        out += p.push(text[last:c])
        last = c
    out += p.flush()
    calls = [x for x in out if isinstance(x, ToolCall)]
    return "".join(x for x in out if isinstance(x, str)), calls


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(calls=CALLS, before=PROSE, cuts=st.lists(st.integers(0, 400), max_size=6))
def test_hermes_calls_parse_back_whole_and_streamed(calls, before, cuts):
    text = before + _hermes(calls)
    content, got = parse_hermes(text)
    assert got == _expected(calls) and content == before.strip()
    s_content, s_calls = _streamed("hermes", text, cuts)
    assert s_calls == _expected(calls) and s_content.strip() == before.strip()


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(calls=CALLS, cuts=st.lists(st.integers(0, 400), max_size=6))
def test_pythonic_calls_parse_back_whole_and_streamed(calls, cuts):
    text = _pythonic(calls)
    assert parse_pythonic(text) == ("", _expected(calls))
    assert _streamed("pythonic", text, cuts) == ("", _expected(calls))


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),  # unbalanced JSON
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}'),  # never closed
        ("hermes", "<tool_call>\n[1, 2]\n</tool_call>"),  # not an object
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
        ("hermes", '<tool_call>\n{"name": "f", "arguments": 3}\n</tool_call>'),
        ("hermes", "<tool_call>" + "[" * 5000 + "</tool_call>"),  # nested past the parser's depth
        ("pythonic", "[f(1)]"),  # positional arguments
        ("pythonic", "[f(a=g())]"),  # not a literal
        ("pythonic", "[f(a=1)"),
        ("pythonic", "[f(**x)]"),
        ("pythonic", "[]"),
        ("pythonic", "[" * 5000),
    ],
)
def test_a_malformed_call_is_text(parser, text):
    assert parse(parser, text) is None
    content, calls = _streamed(parser, text, [3, 17])
    if parser == "pythonic" or text.count("</tool_call>") == 0 or calls == []:
        assert calls == [] and content == text


def test_plain_text_streams_as_it_comes_and_holds_only_a_possible_tag():
    p = StreamParser("hermes")
    assert p.push("Hello <tool") == ["Hello "]
    assert p.push("s are nice") == ["<tools are nice"]
    assert p.flush() == []


def test_call_schema_names_one_tool_or_any():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "ab"]
    assert call_schema(tools, "b")["properties"]["name"] == {"const": "b"}
    assert [b["properties"]["name"]["const"] for b in call_schema(tools, None)["anyOf"]] == ["a", "b"]


class _Tok:
    def __init__(self, chat_template):
        self.chat_template = chat_template


def test_a_model_without_a_chat_template_serves_chat_only_with_the_operators():
    for wants_tools in (False, True):
        for field, param in (("chat", "messages"), ("prompt", "prompt")):
            with pytest.raises(Abort) as e:
                template_for(_Tok(None), "", wants_tools, field)
            assert (e.value.code, e.value.message, e.value.field) == (Status.INVALID_ARGUMENT, NO_CHAT_TEMPLATE, field)
            api = from_abort(e.value)
            assert api.status == 400 and api.body["error"]["param"] == param
        assert template_for(_Tok(""), "OPERATOR", wants_tools) == "OPERATOR"
    assert template_for(None, "", False) is None  # no tokenizer: the request's own check answers
    assert template_for(_Tok("{{ messages }}"), "", False) is None  # the model's own, as before
    assert template_for(_Tok("{{ messages }}"), "", True) == SHIPPED_TEMPLATE.read_text()
