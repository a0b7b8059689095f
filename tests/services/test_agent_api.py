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

from tests.support.stack import free_port, start_stack
from tests.support.tinytok import EOS, JSON, make_char_tokenizer

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
        http_port=free_port(),
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
