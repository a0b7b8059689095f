"""The Responses API without a server (gateway/responses_*.py): any JSON body is a request or a 400,
input items become the chat messages chat completions would take, the conversation's checks, the
output items and stream events (fed to the ``openai`` client's own stream accumulator), pages of
input items, and stored responses scoped to their tenant."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from common.errors import Abort, Status
from common.loop import Stats
from common.store import MemoryStore
from gateway.openai_errors import ApiError
from gateway.records import Records
from gateway.responses_api import _instructions, _renamed, page
from gateway.responses_input import Conversation, chat_fields, parse_body, read_input, shape
from gateway.responses_output import Events, Output, finished, head
from gateway.responses_store import ResponseStore, StoredResponse, response_key
from gateway.turn import Finished

FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "store", "previous_response_id", "metadata", "stream", "speculation", "include",
    "background", "reasoning", "top_k", "seed", "share", "truncation",
]  # fmt: skip
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ITEM = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]),
        "role": st.sampled_from(["user", "assistant", "developer", "tool"]),
        "content": st.text(max_size=6),
        "call_id": st.sampled_from(["c1", "c2"]),
        "name": st.sampled_from(["f", ""]),
        "arguments": st.just("{}"),
        "output": st.text(max_size=4),
    }  # fmt: skip
)
BODY = st.dictionaries(
    st.sampled_from(FIELDS), JSON_VALUE | st.lists(ITEM, min_size=1, max_size=4) | st.just("m"), max_size=8
)
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(body=BODY | JSON_VALUE)
def test_any_body_is_a_request_or_a_400(body):
    try:
        b = parse_body(body)
        inp = read_input(b, Conversation(), False)
        sh = shape(b, "hermes")
    except ApiError as e:
        assert e.status == 400
        err = e.body["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        assert err["param"] is None or err["param"] in FIELDS or err["param"] == "text.format", err
        return
    assert isinstance(body, dict) and b.model == body["model"]
    assert inp.messages and all(m["role"] in ("system", "user", "assistant", "tool") for m in inp.messages)
    assert len(inp.items) == (1 if isinstance(b.input, str) else len(b.input))
    assert sh.parser in ("", "hermes")


def _read(items, before=None, continued=False, **body):
    b = parse_body({"model": "m", "input": items, **body})
    return read_input(b, before or Conversation(), continued)


def test_items_become_chat_messages():
    inp = _read(
        [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "not json"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        ]
    )  # fmt: skip
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c1"}
    assert inp.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": call["function"]},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
    ]  # fmt: skip
    assert inp.after.calls == {"c1": True, "c2": True}
    assert [it["id"][:3] for it in inp.items] == ["msg", "msg", "msg", "fc_", "fc_", "fco", "fco"]
    fields = chat_fields(inp.messages)
    assert fields["chat"][2] == ("assistant", "Let me look.") and json.loads(fields["chat_extra"][2])["tool_calls"]
    assert fields["chat_extra"][0] == "" and json.loads(fields["chat_extra"][3]) == {"tool_call_id": "c2"}
    # a call alone opens an assistant message of its own
    lone = _read([{"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"}]).messages
    assert lone == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "f", "arguments": {}}}]}]  # fmt: skip


def _refused(items, *, before=None, continued=False, says: str, **body) -> dict:
    with pytest.raises(ApiError) as e:
        _read(items, before, continued, **body)
    err = e.value.body["error"]
    assert e.value.status == 400 and says in err["message"], err
    return err


def test_the_conversations_checks():
    before = Conversation({"c1": False, "c0": True}, ["msg_a", "fc_b"])
    answer = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    assert _read([answer], before, True).after.calls == {"c0": True, "c1": True}
    _refused([{**answer, "call_id": "nope"}], says="no function call of this conversation")
    _refused([{**answer, "call_id": "c0"}], before=before, continued=True, says="already answered")
    _refused([answer, answer], before=before, continued=True, says="already answered")
    for item in ({"type": "message", "role": "assistant", "id": "msg_a", "content": "x"},
                 {"type": "function_call", "id": "fc_b", "call_id": "c7", "name": "f", "arguments": "{}"}):  # fmt: skip
        _refused([item], before=before, continued=True, says="already in the conversation")
        _read([item], before, False)  # the whole history, no previous_response_id: its own ids are fine
    _refused([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}], before=before,
             continued=True, says="already a call")  # fmt: skip
    err = _refused([{"type": "reasoning", "summary": []}], says="'reasoning' is not an input item")
    assert err["param"] == "input"
    _refused([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], says="text only")
    _refused(["text"], says="an array of input items (objects)")
    assert _refused([{"role": "robot", "content": "x"}], says="input[0].role")["param"] == "input"


def test_tools_and_formats_take_chats_paths():
    sh = shape(parse_body({"model": "m", "input": "x", "tools": [TOOL], "tool_choice": "required"}), "hermes")
    assert sh.grammar.kind == "tool_call" and sh.grammar.field == "tools" and sh.parser == "hermes"
    assert json.loads(sh.tools) == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    named = {"model": "m", "input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}
    assert json.loads(shape(parse_body(named), "hermes").grammar.text)["properties"]["name"] == {"const": "get_weather"}
    none = shape(parse_body({"model": "m", "input": "x", "tools": [TOOL], "tool_choice": "none"}), "hermes")
    assert (none.tools, none.parser, none.grammar) == ("", "", None)
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}
    sh = shape(parse_body({"model": "m", "input": "x", "text": fmt, "tools": [TOOL]}), "hermes")
    assert sh.grammar.kind == "json_schema" and sh.grammar.field == "text.format" and sh.parser == "hermes"
    for bad, param in (
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
        ({"tool_choice": "required", "tools": [TOOL]}, "tool_choice"),  # with the pythonic parser
        ({"tools": [TOOL, TOOL]}, "tools"),
    ):
        with pytest.raises(ApiError) as e:
            shape(parse_body({"model": "m", "input": "x", **bad}), "pythonic" if "required" in str(bad) else "hermes")
        assert e.value.body["error"]["param"] == param


def test_instructions_stay_those_of_the_conversation():
    prev = _stored("resp_1", "t", instructions="Be brief.")
    body = {"model": "m", "input": "x"}
    assert _instructions(parse_body(body), prev) == "Be brief."
    assert _instructions(parse_body({**body, "instructions": "Be brief."}), prev) == "Be brief."
    with pytest.raises(ApiError) as e:
        _instructions(parse_body({**body, "instructions": "Be long."}), prev)
    assert e.value.body["error"]["param"] == "instructions"


def _finished(n: int, reason: str = "stop") -> Finished:
    return Finished("s1", reason, 5, n, 5 + n, Stats(new_tokens=n, rounds=n), 1.0, 1.0, 1.0, 3.0, 10.0, cached_tokens=3)


def _run(parser: str, pieces: list[str], reason: str = "stop", parallel: bool = True, **body):
    """Every event of a stream whose text comes in ``pieces``, and the finished response object."""
    b = parse_body({"model": "m", "input": "x", **body})
    ev = Events()
    out = Output(parser, parallel, ev)
    obj = head(b, "resp_x", None)
    events = [ev("response.created", response=obj), ev("response.in_progress", response=obj)]
    for p in pieces:
        events += out.push(p)
    events += out.finish(reason == "length")
    done = finished(obj, out, _finished(7, reason), True, None)
    events.append(ev(f"response.{done['status']}", response=done))
    return events, done


def _client_reads(events) -> object:
    """The openai client's own stream accumulator over the events: its final response."""
    state = ResponseStreamState(input_tools=[TOOL], text_format=omit)
    for e in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    return state._completed_response


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


CASES = {
    "text": ("Hello, world.", ["message"]),
    "blank": ("  \n", ["message"]),
    "empty": ("", ["message"]),
    "text-call": ("I will look.\n" + CALL, ["message", "function_call"]),
    "two-calls": (CALL + "\n" + CALL, ["function_call", "function_call"]),
    "call-text": (CALL + " Done.", ["function_call", "message"]),
}


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in it.items() if k not in ("id", "call_id")} for it in items]


@pytest.mark.parametrize("case", CASES)
def test_items_and_events_are_the_same_however_the_text_streams(case):
    text, kinds = CASES[case]
    _, done = _run("hermes", [text])
    assert [it["type"] for it in done["output"]] == kinds
    for size in (1, 3, 7):
        events, again = _run("hermes", [text[i : i + size] for i in range(0, len(text), size)])
        assert _without_ids(again["output"]) == _without_ids(done["output"])
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = _client_reads(events)  # the client's accumulator ends with the items the response says
        assert final.model_dump(exclude_none=True)["output"] == again["output"]
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == final.output_text


def test_event_order_of_a_message_and_of_a_call():
    events, _ = _run("hermes", ["Hi ", "there.\n", CALL])
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == [
        "created", "in_progress", "output_item.added", "content_part.added", "output_text.delta",
        "output_text.delta", "output_text.done", "content_part.done", "output_item.done", "output_item.added",
        "function_call_arguments.delta", "function_call_arguments.done", "output_item.done", "completed",
    ]  # fmt: skip
    call = events[-2]["item"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert events[9]["item"]["arguments"] == "" and events[9]["output_index"] == 1


def test_a_cut_answer_is_incomplete_and_parallel_off_keeps_the_first_call():
    events, done = _run("", ["Once upon"], reason="length")
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["output"][0]["status"] == "incomplete" and events[-1]["type"] == "response.incomplete"
    assert "completed_at" not in done
    _, done = _run("hermes", [CALL + CALL], parallel=False)
    assert [it["type"] for it in done["output"]] == ["function_call"]
    u = done["usage"]
    assert u["input_tokens"] == 5 and u["output_tokens"] == 7 and u["total_tokens"] == 12
    assert u["input_tokens_details"] == {"cached_tokens": 3, "cache_write_tokens": 2}


def test_input_items_pages():
    items = [{"id": f"i{k}"} for k in range(5)]
    first = page(items, {"order": "asc", "limit": "2"})
    assert [i["id"] for i in first["data"]] == ["i0", "i1"] and first["has_more"] and first["last_id"] == "i1"
    rest = page(items, {"order": "asc", "after": "i1", "limit": "10"})
    assert [i["id"] for i in rest["data"]] == ["i2", "i3", "i4"] and not rest["has_more"]
    assert [i["id"] for i in page(items, {})["data"]] == ["i4", "i3", "i2", "i1", "i0"]  # desc by default
    for bad in ({"order": "up"}, {"limit": "0"}, {"limit": "x"}, {"after": "zz"}):
        with pytest.raises(ApiError):
            page(items, bad)


def _stored(rid: str, tenant: str, instructions: str | None = None) -> StoredResponse:
    return StoredResponse(id=rid, tenant=tenant, session_id="s1", end=9, instructions=instructions, calls={}, ids=[],
                          input=[], body={"id": rid})  # fmt: skip


def test_stored_responses_are_the_tenants_own():
    store = MemoryStore()
    responses = ResponseStore(Records(store, 60.0, 0.0))

    async def go():
        await responses.save(_stored("resp_a1", "acme"))
        assert (await responses.load("acme", "resp_a1")).body == {"id": "resp_a1"}
        for tenant, rid in (("globex", "resp_a1"), ("acme", "resp_zz"), ("acme", "../resp"), ("acme", "x" * 300)):
            with pytest.raises(Abort) as e:
                await responses.load(tenant, rid, "previous_response_id")
            assert e.value.code is Status.NOT_FOUND and e.value.field == "previous_response_id"
        assert not await responses.delete("globex", "resp_a1")
        await store.set(response_key("acme", "resp_bad"), b'{"id": "resp_bad"}', 60)
        await store.set(response_key("acme", "resp_other"), _stored("resp_a1", "acme").model_dump_json().encode(), 60)
        for rid in ("resp_bad", "resp_other"):
            with pytest.raises(Abort) as e:
                await responses.load("acme", rid)
            assert e.value.code is Status.DATA_LOSS
        assert await responses.delete("acme", "resp_a1")
        with pytest.raises(Abort):
            await responses.load("acme", "resp_a1")

    asyncio.run(go())


def test_the_gateways_fields_are_named_as_this_api_names_them():
    e = _renamed(Abort(Status.INVALID_ARGUMENT, "max_new_tokens: 999, expected 1..64", field="max_new_tokens"))
    assert (e.code, e.field, e.message) == (
        Status.INVALID_ARGUMENT,
        "max_output_tokens",
        "max_output_tokens: 999, expected 1..64",
    )
    kept = Abort(Status.INVALID_ARGUMENT, "speculation.mode: 'warp'", field="speculation.mode")
    assert _renamed(kept) is kept
    gone = _renamed(Abort(Status.NOT_FOUND, "session_id 'x': no such session", field="session_id"))
    assert gone.field == "previous_response_id" and gone.message == "previous_response_id 'x': no such session"
