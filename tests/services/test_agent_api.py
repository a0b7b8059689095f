"""Tools, structured outputs and log-probabilities through the official ``openai`` client, over real
HTTP to a gateway with a real drafter and verifier (the tiny Llama with a character-level tokenizer
that has JSON's characters). The tiny model's free text is noise: a grammar is what makes its output
a tool call or an object, so these tests run tool calls through ``tool_choice`` required or named and
``response_format``; and every constrained output is compared with the same request without drafts.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.support.stack import start_stack
from tests.support.tinytok import EOS, JSON, SPECIAL, make_char_tokenizer

MODEL = "tiny-llama"
TENANT = "agent-acme"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "metric": {"type": "boolean"}},
            "required": ["city", "metric"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
OFF = {"speculation": {"mode": "off"}}


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    rain: bool
    level: Literal["low", "high"]


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer(96, JSON)


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama, tok, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"key-a {TENANT}\n")
    st = start_stack(
        loop_thread,
        tiny_llama,
        api_keys=str(keys),
        tokenizer=tok,
        eos_ids=(EOS,),
        http_port=-1,
        served_model_name=MODEL,
        max_new_tokens=160,
        max_message_bytes=1 << 18,
    )
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(stack):
    url = f"http://127.0.0.1:{stack.gateway_pair[0].http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="key-a", max_retries=0, timeout=60) as c:
        yield c


def _chat(client, **kw):
    kw.setdefault("max_tokens", 150)
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), **kw)


def test_named_tool_call_round_trip(client):
    r = _chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima") and isinstance(args["metric"], bool)
    print(r)


NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_SHAPE_FIRST = {"index", "id", "type", "function"}


def _events(client, **kw):
    kw.setdefault("max_tokens", 150)
    return list(client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), stream=True, **kw))


def _check_tool_stream(events) -> list[dict]:
    """Every tool-call delta against the shape clients expect; the calls reassembled."""
    calls: dict[int, dict] = {}
    reasons = [c.finish_reason for e in events for c in e.choices if c.finish_reason]
    assert reasons == ["tool_calls"], reasons
    assert events[-1].choices[0].finish_reason == "tool_calls" or not events[-1].choices
    for e in events:
        for c in e.choices:
            for d in c.delta.tool_calls or ():
                d = d.model_dump(exclude_none=True)
                if d["index"] not in calls:  # the first delta of a call: index, id, type and name
                    assert set(d) == CALL_SHAPE_FIRST, d
                    assert d["type"] == "function" and d["id"].startswith("call_") and d["function"]["name"]
                    assert d["function"].get("arguments", "") == ""
                    assert d["index"] == len(calls), "calls are numbered from 0 in order"
                    calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
                else:  # later deltas: argument fragments only
                    assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
                    calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_tool_call_streamed_equals_whole(client, choice):
    whole = _chat(client, tools=[WEATHER, TIME], tool_choice=choice)
    calls = _check_tool_stream(_events(client, tools=[WEATHER, TIME], tool_choice=choice))
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert whole.choices[0].finish_reason == "tool_calls"
    json.loads(calls[0]["arguments"])


def test_client_stream_helper_reassembles_tool_calls(client):
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=150
    ) as s:
        kinds = {e.type for e in s}
        final = s.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Paris",
        "Oslo",
        "Lima",
    )
    assert final.choices[0].finish_reason == "tool_calls"


def test_agent_loop_with_tool_results_in_a_kept_session(client):
    """A call, its result as a ``tool`` message, the next call: history accepted whole and per turn."""
    first = _chat(client, tools=[WEATHER], tool_choice=NAMED, extra_body={"session_id": "new"})
    sid = first.model_extra["session_id"]
    call = first.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}
    # the next turn of the kept session carries only the tool's answer
    second = _chat(
        client, messages=[result], tools=[WEATHER, TIME], tool_choice="required", extra_body={"session_id": sid}
    )
    assert second.choices[0].message.tool_calls and second.model_extra["session_id"] == sid
    # the same loop without a session: the whole history, with the assistant's call in it
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True), result]
    third = _chat(client, messages=history, tools=[WEATHER, TIME], tool_choice="required")
    assert third.choices[0].message.tool_calls
    # tool_choice none: no tools reach the template and the text is not read for calls
    plain = _chat(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_parse_helper_returns_a_valid_object(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Forecast, max_tokens=150)
    obj = r.choices[0].message.parsed
    assert isinstance(obj, Forecast), r
    assert Forecast.model_validate_json(r.choices[0].message.content) == obj


def _ids(client, drafts: bool, **kw) -> list[int]:
    extra = {"return_token_ids": True, **({} if drafts else OFF), **kw.pop("extra_body", {})}
    r = _chat(client, extra_body=extra, **kw)
    return r.choices[0].model_extra["token_ids"]


CONSTRAINED = [
    {"tools": [WEATHER, TIME], "tool_choice": "required"},
    {"response_format": {"type": "json_object"}, "max_tokens": 60},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "f", "schema": Forecast.model_json_schema(), "strict": True},
        }
    },
]


@pytest.mark.parametrize("kw", CONSTRAINED, ids=["tool", "json_object", "json_schema"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_constrained_output_with_drafts_equals_without(client, kw, sampling):
    on = _ids(client, True, **kw, **sampling)
    off = _ids(client, False, **kw, **sampling)
    assert on == off


def test_a_verifier_that_ignores_masks_on_tree_nodes_fails_the_equality(client, monkeypatch):
    """Negative control: only the root's mask applied (as a verifier blind to each node's own
    grammar state would), the drafts' tokens leak into the output."""
    from verifier.engine import VerifierSession

    take = VerifierSession._take_masks

    def root_only(self, rows=None):
        masks = take(self, rows)
        if masks is not None:
            masks[1:] = True
        return masks

    kw = CONSTRAINED[2]
    good = _ids(client, False, **kw)
    monkeypatch.setattr(VerifierSession, "_take_masks", root_only)
    assert _ids(client, False, **kw) == good  # without drafts there is only the root
    # drafts from the session's own top-k rows alone (no tenant corpus: the same drafts every run)
    logits = {"speculation": {"mode": "logits", "budget": 16}}
    with pytest.raises(openai.InternalServerError) as e:  # the gateway sees a token its grammar forbids
        print(_chat(client, extra_body={"return_token_ids": True, **logits}, **kw))
    assert "grammar does not allow" in e.value.body["message"]


def test_a_schema_the_library_refuses_is_a_400_naming_it(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, response_format=fmt)
    assert e.value.body["param"] == "response_format" and "no-such-type" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def _logprobs(client, drafts: bool, top: int):
    extra = {} if drafts else OFF
    fmt = CONSTRAINED[2]["response_format"]
    r = _chat(client, logprobs=True, top_logprobs=top, max_tokens=40, extra_body=extra, response_format=fmt)
    return r.choices[0].logprobs.content, r.choices[0].message.content


def test_logprobs_equal_with_and_without_drafts(client):
    on, text = _logprobs(client, True, 3)
    off, text_off = _logprobs(client, False, 3)
    assert text == text_off and "".join(e.token for e in on if e.token not in SPECIAL) == text
    # float32 model: within float32 rounding of the logits (the verifier's stated bound)
    for a, b in zip(on, off, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        values = [t.logprob for t in a.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert a.logprob <= 0 and values[0] >= a.logprob - 1e-6


def test_completion_logprobs_streamed_equal_whole(client):
    kw = dict(model=MODEL, prompt="The weather", max_tokens=12, logprobs=2)
    whole = client.completions.create(**kw)
    lp = whole.choices[0].logprobs
    # special tokens are entries of their own but no part of the text
    assert "".join(t for t in lp.tokens if t not in SPECIAL) == whole.choices[0].text
    assert len(lp.token_logprobs) == 12 and all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    streamed = [
        t
        for c in client.completions.create(stream=True, **kw)
        for ch in c.choices
        if ch.logprobs
        for t in ch.logprobs.tokens
    ]
    assert streamed == lp.tokens


def test_penalties_and_logit_bias_with_drafts_equal_without(client):
    """Penalties count each node's own path: drafts change nothing, and the bias acts."""
    plain = _ids(client, False, max_tokens=40)
    banned = plain[len(plain) // 2]
    kw = dict(max_tokens=40, presence_penalty=0.7, frequency_penalty=0.9, logit_bias={str(banned): -100})
    off = _ids(client, False, **kw)
    assert banned not in off and off != plain
    for mode in ("racer", "logits"):
        assert _ids(client, True, extra_body={"speculation": {"mode": mode}}, **kw) == off
    # the penalties alone change the output: each repeat is pushed down
    assert _ids(client, False, max_tokens=40, frequency_penalty=2.0) != plain


def test_echo_covers_the_prompt_with_the_models_own_logprobs(client, tok):
    """A completion's tokens, sent back as the prompt with ``echo``: the prompt's log-probabilities
    there are the completion's (one distribution, whether the model generated or read the tokens)."""
    prompt = tok("The weather", add_special_tokens=False)["input_ids"]
    first = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, logprobs=2, extra_body={"return_token_ids": True}
    )
    gen = first.choices[0].model_extra["token_ids"]
    echo = client.completions.create(model=MODEL, prompt=prompt + gen, max_tokens=1, logprobs=2, echo=True)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(tok.decode(prompt + gen))
    assert len(lp.tokens) == len(prompt) + len(gen) + 1  # the prompt, then the one new token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    want = first.choices[0].logprobs.token_logprobs
    assert lp.token_logprobs[len(prompt) : len(prompt) + len(gen)] == pytest.approx(want, abs=1e-4)
    streamed = [
        t for c in client.completions.create(model=MODEL, prompt=prompt + gen, max_tokens=1, logprobs=2, echo=True,
                                             stream=True)
        for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens
    ]  # fmt: skip
    assert streamed == lp.tokens


SHORT_STRINGS = {
    "type": "json_schema",
    "json_schema": {
        "name": "codes",
        "schema": {
            "type": "object",
            "properties": {k: {"type": "string", "minLength": 3, "maxLength": 3} for k in ("first", "second", "third")},
            "required": ["first", "second", "third"],
            "additionalProperties": False,
        },
    },
}


def test_a_resting_budget_still_drafts_what_the_grammar_forces(stack, client):
    """While the adaptive budget rests (here every drafted round looks far too dear), a round whose
    grammar forces tokens after its root still goes to the drafter: the forced stretch (a key and its
    punctuation after each fixed-length string) is drafted as a path, free, instead of taking a round
    per token. The object is the one without drafts."""
    from gateway.turn_links import RoundOverhead

    gw = stack.gateway_pair[1]
    kept = gw.round_overhead
    gw.round_overhead = RoundOverhead(10_000.0)
    try:
        r = _chat(client, response_format=SHORT_STRINGS, extra_body={"speculation": {"budget": 0}})
    finally:
        gw.round_overhead = kept
    plain = _chat(client, response_format=SHORT_STRINGS, extra_body=OFF)
    assert r.choices[0].message.content == plain.choices[0].message.content
    rounds, tokens = r.model_extra["speculation"]["rounds"], r.usage.completion_tokens
    assert rounds * 3 < tokens, (rounds, tokens)
