"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` client and the OpenAI
Agents SDK, over real HTTP to gateways in this process with a real drafter, verifier and Redis.

The tiny Llama with a character-level tokenizer that has JSON's characters: its free text is noise
(special tokens among it, which the text leaves out), so where a response's text is sent back as
history and must give the same tokens, its output is constrained (a JSON schema, a tool call) and
every character is one token. Every answer is compared token for token with chat completions over
the whole history, or with plain greedy decoding of the session's tokens.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from typing import Literal
from urllib.parse import urlsplit

import openai
import pytest
from pydantic import BaseModel

from common.text import continue_ids, messages_ids
from racer import launch as services
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.stack import INTERNAL_TOKEN, start_stack
from tests.support.tinytok import EOS, JSON, make_char_tokenizer

MODEL = "tiny-llama"
TENANT = "responses-acme"
NOTE = {
    "type": "object",
    "properties": {"note": {"type": "string", "maxLength": 12}, "mood": {"enum": ["calm", "bold"]}},
    "required": ["note", "mood"],
    "additionalProperties": False,
}
TEXT = {"format": {"type": "json_schema", "name": "note", "schema": NOTE, "strict": True}}
CHAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "note", "schema": NOTE, "strict": True}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
NAMED = {"type": "function", "name": "get_weather"}
ASK = "What is the weather in Paris?"
OFF = {"speculation": {"mode": "off"}}


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    rain: bool


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer(96, JSON)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(f"key-a {TENANT}\nkey-b responses-globex\n")
    return str(path)


GATEWAY = dict(http_port=-1, served_model_name=MODEL, max_new_tokens=160, max_message_bytes=1 << 18)


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama, tok, redis_url, keys):
    st = start_stack(
        loop_thread,
        tiny_llama,
        api_keys=keys,
        tokenizer=tok,
        eos_ids=(EOS,),
        snapshot_url=redis_url,
        session_url=redis_url,
        **GATEWAY,
    )
    yield st
    st.stop()


def _url(srv) -> str:
    return f"http://127.0.0.1:{srv.http_port}/v1"


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=_url(stack.gateway_pair[0]), api_key="key-a", max_retries=0, timeout=60) as c:
        yield c


def _ids(r) -> list[int]:
    return r.model_extra["token_ids"]


def _create(client, **kw):
    kw.setdefault("max_output_tokens", 150)
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return client.responses.create(model=MODEL, extra_body=extra, **kw)


def _chat_ids(client, messages, **kw) -> list[int]:
    kw.setdefault("max_tokens", 150)
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    r = client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **kw)
    return r.choices[0].model_extra["token_ids"]


def _sessions(stack, key="key-a") -> set[str]:
    with Client(stack.gateway, api_key=key, timeout=30) as c:
        return {s.session_id for s in c.list_sessions()}


def test_create_retrieve_list_and_delete(client, tok, tiny_llama):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, tiny model!"}]
    r = _create(client, input=messages[1]["content"], instructions="Be brief.", max_output_tokens=24,
                metadata={"k": "v"})  # fmt: skip
    prompt = messages_ids(tok, messages)
    assert _ids(r) == hf_greedy(tiny_llama, prompt, 24, eos=(EOS,)) == _chat_ids(client, messages, max_tokens=24)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.status == "incomplete" and [p.type for p in msg.content] == ["output_text"]
    assert msg.content[0].annotations == [] and r.output_text == tok.decode(_ids(r), skip_special_tokens=True)
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (len(prompt), 24, len(prompt) + 24)
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Be brief." and r.metadata == {"k": "v"} and r.store is True
    assert r.temperature == 0.0 and r.top_p == 1.0 and r.tool_choice == "auto" and r.tools == []
    assert r.text.format.type == "text" and r.previous_response_id is None and r.error is None

    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)
    (item,) = items.data
    assert item.type == "message" and item.role == "user" and item.content[0].text == messages[1]["content"]
    client.responses.delete(r.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            call(r.id)


def _events(client, **kw) -> list:
    kw.setdefault("max_output_tokens", 150)
    with client.responses.stream(model=MODEL, **kw) as s:
        return list(s)


TEXT_EVENTS = ["response.output_item.added", "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_stream_events_in_order_and_deltas_join_to_the_text(client):
    whole = _create(client, input="Tell me a story.", max_output_tokens=30)
    events = _events(client, input="Tell me a story.", max_output_tokens=30)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", *TEXT_EVENTS, *["response.output_text.delta"] *
                     len(deltas), *TEXT_DONE, "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == whole.output_text and deltas[-1].snapshot == text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == text and final.id == events[0].response.id
    assert {d.item_id for d in deltas} == {final.output[0].id} and final.usage.output_tokens == 30
    assert client.responses.retrieve(final.id).output_text == text

    # a constrained answer completes (the grammar ends it): the helper's final response, parsed
    with client.responses.stream(model=MODEL, input="Weather?", text_format=Forecast, max_output_tokens=150) as s:
        final = s.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Forecast)


def test_parse_returns_a_valid_object_with_drafts_and_without(client):
    r = client.responses.parse(model=MODEL, input=ASK, text_format=Forecast, max_output_tokens=150)
    assert isinstance(r.output_parsed, Forecast) and r.status == "completed"
    off = client.responses.parse(model=MODEL, input=ASK, text_format=Forecast, max_output_tokens=150, extra_body=OFF)
    assert off.output_parsed == r.output_parsed
    assert Forecast.model_validate_json(r.output_text) == r.output_parsed


def _call_of(r):
    (fc,) = [it for it in r.output if it.type == "function_call"]
    assert fc.id.startswith("fc_") and fc.call_id.startswith("call_") and fc.status == "completed"
    assert fc.name == "get_weather" and json.loads(fc.arguments)["city"] in ("Paris", "Oslo", "Lima")
    return fc


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_tool_round_trip_equals_chat(client, stream):
    kw = dict(input=ASK, tools=[WEATHER], tool_choice=NAMED)
    if stream:
        events = _events(client, **kw)
        kinds = [e.type for e in events]
        assert kinds[2:4] == ["response.output_item.added", "response.function_call_arguments.delta"]
        assert kinds[-3:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        first = events[-1].response
        assert _call_of(first).arguments == args
    else:
        first = _create(client, **kw)
    fc = _call_of(first)
    assert first.status == "completed"
    answer = {"type": "function_call_output", "call_id": fc.call_id, "output": '{"temp": 21}'}
    second = _create(client, input=[answer], previous_response_id=first.id, tools=[WEATHER], tool_choice="required")
    _call_of(second)
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": fc.call_id, "type": "function", "function": {"name": fc.name, "arguments": fc.arguments}}]},
        {"role": "tool", "tool_call_id": fc.call_id, "content": '{"temp": 21}'},
    ]  # fmt: skip
    assert _ids(second) == _chat_ids(client, history, tools=[CHAT_WEATHER], tool_choice="required")
    # the same history sent whole, without previous_response_id: the same answer
    items = [{"type": "message", "role": "user", "content": ASK}, fc.model_dump(exclude_none=True), answer]
    again = _create(client, input=items, tools=[WEATHER], tool_choice="required", store=False)
    assert _ids(again) == _ids(second)


@pytest.mark.parametrize("spec", [{}, OFF], ids=["drafts", "no-drafts"])
def test_a_chain_of_responses_is_chat_over_the_whole_history(stack, client, spec):
    """Three responses chained by previous_response_id, each token for token what chat completions
    gives for the whole history; each continues the same session, its earlier tokens held."""
    history = [{"role": "system", "content": "Answer in JSON."}]
    prev = None
    for i, say in enumerate(["Hi!", "And now?", "Last one."]):
        r = _create(client, input=say, instructions="Answer in JSON." if i == 0 else None, text=TEXT,
                    previous_response_id=prev and prev.id, extra_body=spec)  # fmt: skip
        history.append({"role": "user", "content": say})
        assert _ids(r) == _chat_ids(client, history, response_format=CHAT_FORMAT), i
        history.append({"role": "assistant", "content": r.output_text})
        assert r.status == "completed" and r.previous_response_id == (prev and prev.id)
        assert r.instructions == "Answer in JSON."
        if prev is not None:
            assert r.model_extra["session_id"] == prev.model_extra["session_id"]  # the same session, continued
            held = prev.usage.total_tokens
            assert r.usage.input_tokens > held and r.usage.input_tokens_details.cached_tokens >= held - 1
        prev = r


def test_a_request_that_ignores_the_kept_session_answers_the_same_and_its_cached_tokens_show_it(client):
    """Negative control: the same conversation sent whole (``store: false``, no previous response)
    gets the continued response's tokens, but prefills its history again: the verifier's count of
    tokens it did not prefill says which one was continued."""
    first = _create(client, input="Hi!", instructions="Answer in JSON.", text=TEXT)
    continued = _create(client, input="And now?", previous_response_id=first.id, text=TEXT)
    items = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And now?"},
    ]
    whole = _create(client, input=items, instructions="Answer in JSON.", text=TEXT, store=False)
    assert _ids(whole) == _ids(continued)
    held = first.usage.total_tokens
    assert continued.usage.input_tokens_details.cached_tokens >= held - 1
    assert whole.usage.input_tokens_details.cached_tokens < held - 1


def test_free_text_is_continued_as_the_sessions_tokens(client, tok, tiny_llama):
    """Free text that does not re-encode to its tokens (special tokens among them): the chain goes on
    from the tokens the session holds, whatever its text says."""
    first = _create(client, input="Once upon a time", max_output_tokens=20)
    second = _create(client, input="Go on.", previous_response_id=first.id, max_output_tokens=20)
    history = messages_ids(tok, [{"role": "user", "content": "Once upon a time"}]) + _ids(first)
    history += continue_ids(tok, history, [{"role": "user", "content": "Go on."}], (EOS,))
    assert _ids(second) == hf_greedy(tiny_llama, history, 20, eos=(EOS,))


def test_a_fork_gives_what_its_history_gives(stack, client):
    root = _create(client, input="Hi!", text=TEXT)
    sid = root.model_extra["session_id"]
    a = _create(client, input="More.", previous_response_id=root.id, text=TEXT)
    assert a.model_extra["session_id"] == sid  # the latest point: continued
    b = _create(client, input="More.", previous_response_id=root.id, text=TEXT)  # root is no longer the latest
    assert b.model_extra["session_id"] != sid and _ids(b) == _ids(a)
    c = _create(client, input="Other.", previous_response_id=root.id, text=TEXT)
    history = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": root.output_text}]
    assert _ids(c) == _chat_ids(client, history + [{"role": "user", "content": "Other."}], response_format=CHAT_FORMAT)
    # the fork's own chain, and the first session's, each go on from their own latest point
    assert _create(client, input="Then?", previous_response_id=a.id, text=TEXT).model_extra["session_id"] == sid
    b2 = _create(client, input="Then?", previous_response_id=b.id, text=TEXT)
    assert b2.model_extra["session_id"] == b.model_extra["session_id"]
    # store: false from any point: a one-call session, closed after, nothing stored
    before = _sessions(stack)
    off = _create(client, input="More.", previous_response_id=root.id, text=TEXT, store=False)
    assert _ids(off) == _ids(a) and "session_id" not in off.model_extra and off.store is False
    assert _sessions(stack) == before
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(off.id)


def test_two_continuations_of_one_point_at_once_the_second_forks(stack, client, monkeypatch):
    """The first continuation holds the session (held in its drafter open); the second sees the same
    latest point, is refused the session before its first token, and runs as a fork: both answer
    what that history gives."""
    root = _create(client, input="Hi!", text=TEXT)
    sid = root.model_extra["session_id"]
    drafter = stack.drafters[0][1]
    real_open = drafter.open
    gate, held = asyncio.Event(), threading.Event()

    async def held_open(req):
        if req.session_id == sid and not gate.is_set():
            held.set()
            await gate.wait()
        return await real_open(req)

    monkeypatch.setattr(drafter, "open", held_open)
    out: dict = {}
    first = threading.Thread(target=lambda: out.update(a=_create(client, input="More.", previous_response_id=root.id,
                                                                   text=TEXT)), daemon=True)  # fmt: skip
    first.start()
    try:
        assert held.wait(60)
        b = _create(client, input="More.", previous_response_id=root.id, text=TEXT)
    finally:
        stack.lt.loop.call_soon_threadsafe(gate.set)
        first.join(60)
    a = out["a"]
    assert a.model_extra["session_id"] == sid and b.model_extra["session_id"] != sid
    assert _ids(a) == _ids(b)


def _error(excinfo) -> dict:
    body = excinfo.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["message"], body
    return body


def test_another_tenants_response_is_a_404_like_a_missing_one(stack, client):
    r = _create(client, input="Mine.", max_output_tokens=4)
    missing = "resp_" + "0" * 48
    with openai.OpenAI(base_url=_url(stack.gateway_pair[0]), api_key="key-b", max_retries=0, timeout=60) as b:
        for rid in (r.id, missing):
            for call in (b.responses.retrieve, b.responses.delete, b.responses.input_items.list):
                with pytest.raises(openai.NotFoundError) as e:
                    call(rid)
                assert _error(e)["message"] == f"Response with id {rid!r} not found.", _error(e)
            with pytest.raises(openai.NotFoundError) as e:
                _create(b, input="Yours?", previous_response_id=rid)
            assert _error(e)["param"] == "previous_response_id"
            assert _error(e)["message"] == f"Response with id {rid!r} not found."
    assert client.responses.retrieve(r.id).id == r.id  # still there for its own tenant


def test_a_chain_goes_on_through_a_second_gateway_replica(loop_thread, stack, client, tok, tiny_llama, redis_url, keys):
    args = services.defaults(
        "gateway", host="127.0.0.1", port=0, model="none", session_url=redis_url, api_keys=keys,
        drafters=f"127.0.0.1:{stack.drafters[0][0].port}", verifiers=f"127.0.0.1:{stack.verifiers[0][0].port}",
        internal_token=INTERNAL_TOKEN, **GATEWAY,
    )  # fmt: skip
    srv, _ = loop_thread.run(
        services.start_gateway(args, tokenizer=tok, eos_ids=(EOS,), vocab_size=tiny_llama.config.vocab_size)
    )
    try:
        with openai.OpenAI(base_url=_url(srv), api_key="key-a", max_retries=0, timeout=60) as other:
            first = _create(client, input="Hi!", text=TEXT)
            second = _create(other, input="More.", previous_response_id=first.id, text=TEXT)
            third = _create(client, input="Again.", previous_response_id=second.id, text=TEXT)
            assert other.responses.retrieve(third.id).model_dump() == third.model_dump()
        history = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": first.output_text}]
        history += [{"role": "user", "content": "More."}, {"role": "assistant", "content": second.output_text}]
        history += [{"role": "user", "content": "Again."}]
        assert _ids(third) == _chat_ids(client, history, response_format=CHAT_FORMAT)
        assert {r.model_extra["session_id"] for r in (first, second, third)} == {first.model_extra["session_id"]}
    finally:
        loop_thread.run(srv.stop(0))


def test_bad_requests_are_openai_errors(stack, client):
    r = _create(client, input=ASK, tools=[WEATHER], tool_choice=NAMED)
    fc = _call_of(r)
    missing = "resp_" + "1" * 48
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(missing)
    assert _error(e)["code"] == "not_found"
    with pytest.raises(openai.NotFoundError) as e:
        _create(client, input="x", previous_response_id=missing)
    assert _error(e)["param"] == "previous_response_id"
    msg = r.output[0]
    cases = [
        (dict(input=[{"type": "telepathy", "content": "x"}]), "input", "telepathy"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input", "text"),
        (dict(input=[{"type": "function_call_output", "call_id": "call_never", "output": "1"}]), "input", "call_never"),
        # with previous_response_id: an item of that conversation sent again, a call answered twice
        (dict(input=[{"type": "message", "role": "assistant", "id": msg.id, "content": "I said otherwise."},
                     {"role": "user", "content": "Well?"}], previous_response_id=r.id), "input", msg.id),
        (dict(input=[fc.model_dump(exclude_none=True)], previous_response_id=r.id), "input", fc.id),
        (dict(input=[{k: v for k, v in fc.model_dump(exclude_none=True).items() if k != "id"}],
              previous_response_id=r.id), "input", fc.call_id),
        (dict(input="x", instructions="New rules.", previous_response_id=r.id), "instructions", "instructions"),
        (dict(input="x", tools=[{"type": "web_search"}]), "tools", "tools"),
        (dict(input="x", tool_choice="required"), "tool_choice", "requires tools"),
        (dict(input="x", text={"format": {"type": "json_schema", "name": "f", "schema": {"type": "nope"}}}),
         "text.format", "nope"),
        (dict(input="x", background=True), "background", "background"),
        (dict(input="x", max_output_tokens=10_000), "max_output_tokens", "max_output_tokens: 10000"),  # the limit: 160
        (dict(input=[]), "input", "input"),
    ]  # fmt: skip
    for kw, param, says in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _create(client, **kw)
        assert _error(e)["param"] == param and says in _error(e)["message"], (kw, _error(e))
    answer = {"type": "function_call_output", "call_id": fc.call_id, "output": "21"}
    second = _create(client, input=[answer], previous_response_id=r.id, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:  # answered already, in the previous response
        _create(client, input=[answer], previous_response_id=second.id)
    assert "already answered" in _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:  # nothing of this server runs in the background
        client.responses.cancel(r.id)
    assert "background" in _error(e)["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel(missing)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-5", input="x")
    assert _error(e)["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_after_the_turn_began_is_an_error_or_a_failed_event(stack, client, monkeypatch, stream):
    async def boom(rec, lease=None):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(stack.gateway_pair[1].records, "save", boom)
    if not stream:
        with pytest.raises(openai.InternalServerError) as e:
            _create(client, input="hi", max_output_tokens=4)
        assert "internal error (id " in str(e.value) and "secret" not in str(e.value)
        return
    events = _events(client, input="hi", max_output_tokens=4)
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert "internal error (id " in last.response.error.message and "secret" not in last.response.error.message


def _url_parts(client):
    u = urlsplit(str(client.base_url))
    return u.hostname, u.port, u.path.rstrip("/")


def test_input_items_pages(client):
    items = [{"role": "user", "content": f"Item {i}."} for i in range(5)]
    r = _create(client, input=items, max_output_tokens=2)
    pages = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [it.content[0].text for it in pages.data] == ["Item 0.", "Item 1."] and pages.has_more
    assert [it.content[0].text for it in pages] == [f"Item {i}." for i in range(5)]  # the client pages with after
    assert [it.content[0].text for it in client.responses.input_items.list(r.id)] == [
        f"Item {i}." for i in (4, 3, 2, 1, 0)
    ]
    host, port, path = _url_parts(client)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", f"{path}/responses/{r.id}/input_items?limit=0", headers={"Authorization": "Bearer key-a"})
    resp = conn.getresponse()
    assert resp.status == 400 and json.loads(resp.read())["error"]["param"] == "limit"


def test_an_agents_sdk_agent_calls_its_tool_and_answers(stack):
    """An Agents SDK ``Agent`` with a ``@function_tool`` over ``/v1/responses``: the named tool is
    called (the grammar makes the call), its output goes back, and the final answer is the agent's
    output type; the whole history each turn, and chained by previous_response_id."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny in {city}"

    class Answer(BaseModel):
        city: Literal["Paris", "Oslo"]
        sunny: bool

    async def run(chained: bool):
        async with openai.AsyncOpenAI(base_url=_url(stack.gateway_pair[0]), api_key="key-a", max_retries=0) as c:
            agent = Agent(
                name="weather",
                instructions="Use the tool, then answer.",
                tools=[get_weather],
                output_type=Answer,
                model=OpenAIResponsesModel(model=MODEL, openai_client=c),
                model_settings=ModelSettings(tool_choice="get_weather", max_tokens=150),
            )
            result = await Runner.run(agent, ASK, auto_previous_response_id=chained)
            ids = [m.response_id for m in result.raw_responses]
            last = await c.responses.retrieve(ids[-1])
            return result, ids, last

    for chained in (False, True):
        result, ids, last = asyncio.run(run(chained))
        kinds = [type(i).__name__ for i in result.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
        assert isinstance(result.final_output, Answer) and len(ids) == 2
        assert result.new_items[1].output == f"Sunny in {cities[-1]}"
        assert last.previous_response_id == (ids[0] if chained else None)
        assert last.instructions == "Use the tool, then answer."
    assert len(cities) == 2 and cities[0] == cities[1]  # greedy: the same call both times
