"""The OpenAI API without a server (gateway/openai_requests.py, gateway/openai_errors.py): any JSON body
is a Call or a 400 (never a crash), an error names its field, and every gRPC status has its HTTP status."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import Abort, Status
from gateway.openai_bodies import _NO_OP
from gateway.openai_errors import ApiError, from_abort
from gateway.openai_requests import parse
from gateway.requests import Limits, check

FIELDS = [
    "model", "messages", "prompt", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "seed", "top_k", "stop", "speculation", "session_id", "logprobs", "tools",
    "response_format", "return_token_ids", "presence_penalty", "echo",
]  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
GOOD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": st.text(max_size=8)}
)
BODY = st.dictionaries(
    st.sampled_from(FIELDS),
    JSON | st.lists(GOOD_MESSAGE, min_size=1, max_size=3) | st.sampled_from(["m", "new", ["a", "b"], {"mode": "pld"}]),
    max_size=8,
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(body=BODY | JSON, chat=st.booleans())
def test_any_body_is_a_call_or_a_400(body, chat):
    try:
        call = parse(body, chat)
    except ApiError as e:
        assert e.status == 400
        err = e.body["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        assert err["param"] is None or err["param"] in FIELDS
        return
    r = call.request
    assert isinstance(body, dict) and call.model == body["model"]
    assert r.input == ("chat" if chat else r.input) and r.input in ("chat", "text", "prompt_ids")
    assert r.chat if chat else (r.prompt or r.prompt_ids)
    assert r.max_new_tokens >= 0 and r.temperature >= 0 and 0 <= r.top_p <= 1
    assert call.keep_session == bool(body.get("session_id"))


def test_fields_map_to_the_request():
    call = parse(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "x",
            "top_k": -1,
            "speculation": {"mode": "pld", "budget": 8},
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        chat=True,
        session_header="abc",
    )
    r = call.request
    assert r.chat == (("system", "ab"),) and r.max_new_tokens == 7 and r.temperature == 0.5 and r.top_p == 0.9
    assert r.seed == 3 and r.stop == ("x",) and call.stop == ("x",) and r.top_k == 0
    assert (r.mode, r.budget) == ("pld", 8) and r.session_id == "abc" and call.keep_session
    assert call.stream and call.include_usage
    new = parse({"model": "m", "prompt": "hi", "session_id": "new"}, chat=False)
    assert new.request.session_id == "" and new.keep_session and new.request.input == "text"
    ids = parse({"model": "m", "prompt": [[1, 2, 3]]}, chat=False)
    assert ids.request.input == "prompt_ids" and ids.request.prompt_ids == (1, 2, 3)
    assert ids.request.share  # a turn goes into the tenant corpus unless it says otherwise
    assert not parse({"model": "m", "prompt": "hi", "share": False}, chat=False).request.share
    with pytest.raises(ApiError) as e:
        parse({"model": "m", "prompt": "hi", "share": "no"}, chat=False)
    assert e.value.status == 400 and e.value.body["error"]["param"] == "share"


# What a client of this API sees for each gRPC status, written down independently of the module:
# the HTTP status from the mapping documented beside the codes in google/rpc/code.proto (499 for
# CANCELLED: "client closed request"), and the error type an OpenAI client expects with it.
EXPECTED_HTTP = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "invalid_request_error"),
    "ABORTED": (409, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
    "CANCELLED": (499, "cancelled_error"),
    "DATA_LOSS": (500, "server_error"),
    "INTERNAL": (500, "server_error"),
    "UNKNOWN": (500, "server_error"),
}


def test_the_expected_table_names_every_status():
    assert set(EXPECTED_HTTP) == {s.name for s in Status}


@pytest.mark.parametrize("status", list(Status))
def test_every_status_has_an_http_status(status):
    e = from_abort(Abort(status, "max_new_tokens: 9, expected 1..8", field="max_new_tokens"))
    assert (e.status, e.body["error"]["type"]) == EXPECTED_HTTP[status.name]
    assert e.body["error"]["param"] == "max_tokens" and e.body["error"]["message"].startswith("max_new_tokens")
    assert from_abort(Abort(status, "missing or unknown API key")).body["error"]["param"] is None


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "fields, param, where",
    [
        ({"model": 3}, "model", "model"),
        ({"model": ""}, "model", "model"),
        ({"n": 2}, "n", "n"),
        ({"n": True}, "n", "n"),
        ({"stream": "yes"}, "stream", "stream"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options", "stream_options.include_usage"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"max_completion_tokens": 1.0}, "max_completion_tokens", "max_completion_tokens"),
        ({"temperature": 2.5}, "temperature", "temperature"),
        ({"temperature": True}, "temperature", "temperature"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"seed": 2**63}, "seed", "seed"),
        ({"top_k": -2}, "top_k", "top_k"),
        ({"stop": ["a", 1]}, "stop", "stop"),
        ({"speculation": {"mode": "pld", "budget": "8"}}, "speculation", "speculation.budget"),
        ({"session_id": 5}, "session_id", "session_id"),
        ({"return_token_ids": 1}, "return_token_ids", "return_token_ids"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "response_format"),
        ({"tool_choice": "always"}, "tool_choice", "tool_choice"),
        ({"top_logprobs": 21}, "top_logprobs", "top_logprobs"),
        ({"messages": []}, "messages", "messages"),
        ({"messages": [CHAT["messages"][0], {"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
         "messages[1].content"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages", "messages[0]"),
    ],
)  # fmt: skip
def test_a_field_error_names_the_field(fields, param, where):
    """The OpenAI error's ``param`` is the top-level field; the message points into it."""
    with pytest.raises(ApiError) as e:
        parse({**CHAT, **fields}, chat=True)
    err = e.value.body["error"]
    assert e.value.status == 400 and err["type"] == "invalid_request_error" and err["code"] is None
    assert err["param"] == param and err["message"].startswith(f"{where}: "), err


@pytest.mark.parametrize("name, value", [(name, ok[0]) for name, ok in _NO_OP.items()])
def test_unimplemented_fields_pass_at_their_no_op_value_only(name, value):
    assert parse({**CHAT, name: value}, chat=True).model == "m"
    assert parse({**CHAT, name: None}, chat=True).model == "m"
    with pytest.raises(ApiError) as e:
        parse({**CHAT, name: "something"}, chat=True)
    err = e.value.body["error"]
    assert (err["param"], err["code"]) == (name, "unsupported_parameter") and e.value.status == 400


@pytest.mark.parametrize(
    "field, param",
    [("max_new_tokens", "max_tokens"), ("chat", "messages"), ("text", "prompt"), ("prompt_ids", "prompt"),
     ("prompt", "prompt"), ("speculation.mode", "speculation"), ("session_id", "session_id"),
     ("temperature", "temperature"), ("stop_ids", None), ("system", None), (None, None)],
)  # fmt: skip
def test_the_gateways_field_is_the_apis_param(field, param):
    """An ``Abort`` from the gateway's own checks names its field; the message is not read for it."""
    e = from_abort(Abort(Status.INVALID_ARGUMENT, "temperature: a message that names another field", field=field))
    assert e.status == 400 and e.body["error"]["param"] == param


@pytest.mark.parametrize(
    "fields, param",
    [({"max_tokens": 9}, "max_tokens"), ({"speculation": {"mode": "warp"}}, "speculation"),
     ({"speculation": {"budget": 9}}, "speculation"), ({"stop": ["x"] * 17}, "stop"), ({"stop": [""]}, "stop")],
)  # fmt: skip
def test_the_gateways_own_checks_name_the_field(fields, param):
    """What passes this API's parse but not the gateway's limits is refused there, naming the field."""
    call = parse({**CHAT, **fields}, chat=True)
    with pytest.raises(Abort) as e:
        check(call.request, Limits(max_new_tokens=8, max_budget=8), None)
    assert e.value.code is Status.INVALID_ARGUMENT and from_abort(e.value).body["error"]["param"] == param
