"""The OpenAI-compatible HTTP API through the official ``openai`` client, over real HTTP to a gateway
in this process: chat and completions, streamed and not, sessions, errors. Every output is compared
token for token with the gRPC path and with plain greedy decoding (the tiny Llama with a
character-level tokenizer, so text and tokens are one to one)."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest
import redis
from prometheus_client import REGISTRY

from common.text import continue_ids, messages_ids, text_ids
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.stack import start_stack, wait_until
from tests.support.tinytok import make_char_tokenizer

VOCAB = 96
N = 24
MODEL = "tiny-llama"
TENANT = "openai-acme"  # key-a's: this module's own in the shared Redis
GREEDY = {"temperature": 0, "max_tokens": N}


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama, tok, redis_url, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"key-a {TENANT}\nkey-b globex\n")
    st = start_stack(
        loop_thread,
        tiny_llama,
        api_keys=str(keys),
        tokenizer=tok,
        eos_ids=(),
        snapshot_url=redis_url,
        session_url=redis_url,
        http_port=-1,
        served_model_name=MODEL,
        max_new_tokens=64,
        max_message_bytes=1 << 16,  # HTTP bodies too
    )
    yield st
    st.stop()


@pytest.fixture(scope="module")
def base_url(stack):
    return f"http://127.0.0.1:{stack.gateway_pair[0].http_port}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="key-a", max_retries=0, timeout=60) as c:
        yield c


def _http(base_url: str, method: str, path: str, body: bytes | None = None, key: str | None = "key-a"):
    """A raw HTTP call (what the openai client cannot send): (status, parsed JSON body)."""
    u = urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, u.path + path, body=body, headers={"Authorization": f"Bearer {key}"} if key else {})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _grpc(stack, prompt, **kw):
    with Client(stack.gateway, api_key="key-a", timeout=60) as c:
        ids, text, last = c.complete(prompt, max_new_tokens=N, **kw)
        c.close_session(last.session_id)  # (so that the sessions left are the HTTP calls')
    return ids, text, last


def test_chat_equals_grpc_and_greedy(stack, client, tok, tiny_llama):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, tiny model!"}]
    ref = hf_greedy(tiny_llama, messages_ids(tok, messages), N)
    grpc_ids, grpc_text, _ = _grpc(stack, messages)
    assert grpc_ids == ref

    r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ref
    assert choice.message.content == grpc_text == _text(tok, ref)
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens == len(messages_ids(tok, messages))
    assert r.usage.total_tokens == r.usage.prompt_tokens + N
    spec = r.model_extra["speculation"]
    assert spec["rounds"] >= 1 and spec["accepted"] <= spec["drafted"]
    assert spec["mat"] == pytest.approx((spec["accepted"] + spec["rounds"]) / spec["rounds"], abs=1e-4)
    assert "session_id" not in r.model_extra  # a one-call session: closed, nothing to continue
    assert r.id.startswith("chatcmpl-")

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
            extra_body={"return_token_ids": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == _text(tok, ref)
    assert [t for d in deltas for t in (d.model_extra.get("token_ids") or [])] == ref
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert chunks[-2].model_extra["speculation"]["rounds"] >= 1
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_equal_grpc_and_greedy(stack, client, tok, tiny_llama):
    prompt = "Once upon a time, a model"
    ids = text_ids(tok, prompt)
    ref = hf_greedy(tiny_llama, ids, N)
    assert _grpc(stack, ids)[0] == ref

    r = client.completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.choices[0].text == _text(tok, ref) and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == N

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _text(tok, ref)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None  # no include_usage

    # token ids as the prompt: the same continuation
    r = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert r.choices[0].text == _text(tok, ref)


def test_stop_string_ends_the_text_without_it(client, tok, tiny_llama):
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = _text(tok, hf_greedy(tiny_llama, messages_ids(tok, messages), N))
    stop = full[9:12]
    cut = full.index(stop)
    r = client.chat.completions.create(model=MODEL, messages=messages, stop=[stop, "never~"], **GREEDY)
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_second_turn_through_session_id(stack, base_url, client, tok, tiny_llama, redis_url):
    first = [{"role": "user", "content": "Remember the word apple."}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=first, **GREEDY, extra_body={"session_id": "new", "return_token_ids": True}
    )
    r1 = raw.parse()
    sid = r1.model_extra["session_id"]
    assert raw.headers["x-session-id"] == sid
    history = messages_ids(tok, first)
    assert r1.choices[0].model_extra["token_ids"] == hf_greedy(tiny_llama, history, N)
    history += r1.choices[0].model_extra["token_ids"]

    second = [{"role": "user", "content": "Which word?"}]
    history += continue_ids(tok, history, second, ())
    ref = hf_greedy(tiny_llama, history, N)
    # the header continues the session too; the answer streams
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=second, stream=True, **GREEDY, extra_headers={"X-Session-Id": sid}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == _text(tok, ref)
    assert {c.model_extra["session_id"] for c in chunks} == {sid}
    assert chunks[-1].model_extra["speculation"]["session_tokens"] == len(history) + N

    with Client(stack.gateway, api_key="key-a", timeout=30) as c:
        info = c.get_session(sid)
        assert info.turns == 2 and info.tokens == len(history) + N
        # calls without session_id leave no session behind: no record, no drafter snapshot
        assert [s.session_id for s in c.list_sessions()] == [sid]
    for _, drafter in stack.drafters:
        stack.lt.run(drafter.flush())  # snapshot writes in flight land first
    store = redis.Redis.from_url(redis_url)
    assert {k.decode() for k in store.scan_iter(f"racer:drafter:{TENANT}:*")} == {f"racer:drafter:{TENANT}:{sid}"}
    # another tenant does not see it
    with openai.OpenAI(base_url=base_url, api_key="key-b", max_retries=0) as b:
        with pytest.raises(openai.NotFoundError):
            b.chat.completions.create(model=MODEL, messages=second, **GREEDY, extra_body={"session_id": sid})
    status, body = _http(base_url, "DELETE", f"/sessions/{sid}")
    assert status == 200 and body["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=MODEL, messages=second, **GREEDY, extra_body={"session_id": sid})


def test_models(client, base_url):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def _error(excinfo) -> dict:
    return excinfo.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_errors(client, base_url, stream):
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=chat, stream=stream)
    assert _error(e)["code"] == "model_not_found" and _error(e)["param"] == "model"
    with openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=MODEL, messages=chat, stream=stream)
    assert e.value.status_code == 401 and _error(e)["type"] == "authentication_error"
    cases = [
        ({"n": 2}, "n"),
        ({"max_tokens": 10_000}, "max_tokens"),  # over the gateway's limit (64)
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"seed": 2**70}, "seed"),
        ({"extra_body": {"top_k": 2**40}}, "top_k"),
        ({"extra_body": {"speculation": {"mode": "warp"}}}, "speculation"),
        ({"extra_body": {"session_id": "no-such-session"}}, "session_id"),
    ]
    for kw, param in cases:
        err = openai.NotFoundError if param == "session_id" else openai.BadRequestError
        with pytest.raises(err) as e:
            client.chat.completions.create(model=MODEL, messages=chat, stream=stream, **kw)
        assert _error(e)["param"] == param, (kw, _error(e))
        assert _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}], stream=stream)
    assert _error(e)["param"] == "messages"
    for prompt in ([[1, 2], [3, 4]], [1, 2**40], [5, -1]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, stream=stream)
        assert _error(e)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:  # the gateway's own vocabulary check
        client.completions.create(model=MODEL, prompt=[5, VOCAB], stream=stream)
    assert _error(e)["param"] == "prompt" and "vocabulary" in _error(e)["message"]


def test_malformed_http(base_url):
    deep = b'{"model": "tiny-llama", "messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # under the size limit
    huge = b'{"model": "tiny-llama", "prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}"
    bodies = [b"{not json", b"[1, 2]", b'{"model": 3}', b"\xff", deep, huge]
    bodies += [b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xc3\x28"}]}']  # bad UTF-8
    bodies += [b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}']  # lone surrogate
    for field in ("max_tokens", "temperature", "top_p", "seed", "n", "max_completion_tokens"):
        for number in (b"1e999", b"-1e999", b"1" + b"0" * 400, b"-" + b"9" * 400, b"1e-999"):
            bodies.append(
                b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "%s": %s}'
                % (
                    field.encode(),
                    number,
                )
            )
    for body in bodies:
        status, r = _http(base_url, "POST", "/chat/completions", body)
        assert status in (200, 400) and (status == 200 or r["error"]["type"] == "invalid_request_error"), (body[:80], r)
        if body is deep or body is huge or b"\xc3" in body or b"ud800" in body or body in bodies[:4]:
            assert status == 400, (body[:80], r)
    for key in ("nope", None):
        for method, path in (("POST", "/chat/completions"), ("GET", "/models")):
            status, r = _http(base_url, method, path, b"{}", key=key)
            assert status == 401 and r["error"]["code"] == "invalid_api_key"
    status, r = _http(base_url, "GET", "/nowhere")
    assert status == 404 and r["error"]["message"]
    status, r = _http(base_url, "GET", "/chat/completions")
    assert status == 405 and r["error"]["message"]
    status, r = _http(base_url, "POST", "/chat/completions", b" " * (1 << 17))
    assert status == 413 and r["error"]["code"] == "request_too_large"


def test_sampling_with_a_seed_is_the_grpc_path(stack, client, tok, tiny_llama):
    """temperature, top_p, top_k and seed mean what they mean over gRPC: the same seed, the same tokens."""
    messages = [{"role": "user", "content": "Surprise me."}]
    kw = dict(temperature=0.9, top_p=0.95, top_k=40, seed=11)
    grpc_ids, _, _ = _grpc(stack, messages, **kw)
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=N,
        temperature=0.9,
        top_p=0.95,
        seed=11,
        extra_body={"top_k": 40, "return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] == grpc_ids
    assert grpc_ids != hf_greedy(tiny_llama, messages_ids(tok, messages), N)  # it did sample


class Held:
    """A stack whose drafter holds every session open until ``gate`` is set (in the services' loop)."""

    def __init__(self, loop_thread, tiny_llama, tok, hold=lambda req: True, **gateway):
        self.lt = loop_thread
        self.st = start_stack(loop_thread, tiny_llama, tokenizer=tok, http_port=-1, served_model_name=MODEL, **gateway)
        self.srv, self.gw = self.st.gateway_pair
        self.base_url = f"http://127.0.0.1:{self.srv.http_port}/v1"
        self.gate, self.opened = asyncio.Event(), asyncio.Event()
        drafter = self.st.drafters[0][1]
        real_open = drafter.open

        async def held_open(req):
            if hold(req):  # (``hold``: which sessions are held, by their open request)
                self.opened.set()
                await self.gate.wait()
            return await real_open(req)

        drafter.open = held_open

    def wait_held(self):
        self.lt.run(self.opened.wait())

    def release(self):
        self.lt.loop.call_soon_threadsafe(self.gate.set)


def test_shutdown_drains_http_turns(loop_thread, tiny_llama, tok):
    """SIGTERM's path (``Server.stop``): a turn in flight over HTTP finishes, a new one is refused
    with 503, then the HTTP port closes."""
    h = Held(loop_thread, tiny_llama, tok)
    messages = [{"role": "user", "content": "Drain me."}]
    result: dict = {}

    def call():
        with openai.OpenAI(base_url=h.base_url, api_key="none", max_retries=0, timeout=60) as c:
            result["r"] = c.chat.completions.create(model=MODEL, messages=messages, **GREEDY)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    h.wait_held()
    stop = asyncio.run_coroutine_threadsafe(h.srv.stop(30), loop_thread.loop)
    wait_until(lambda: h.gw.stopping is not None, what="the gateway draining")
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    status, r = _http(h.base_url, "POST", "/chat/completions", body, key=None)
    assert status == 503 and "shutting down" in r["error"]["message"], r
    assert not stop.done() and t.is_alive()
    h.release()
    stop.result(60)
    t.join(60)
    ref = hf_greedy(tiny_llama, messages_ids(tok, messages), N)
    assert result["r"].choices[0].message.content == _text(tok, ref)
    with pytest.raises(ConnectionError):  # the HTTP port is closed
        _http(h.base_url, "GET", "/models", key=None)
    h.st.stop()


def test_a_session_closed_while_its_turn_runs_is_a_409_about_the_session_id(loop_thread, tiny_llama, tok):
    """DELETE /v1/sessions/{id} ends the session's running turn: its caller gets ABORTED as a 409
    whose param is session_id (the gateway's field, carried by the turn's stop)."""
    h = Held(loop_thread, tiny_llama, tok)
    got: dict = {}

    def call():
        with openai.OpenAI(base_url=h.base_url, api_key="none", max_retries=0, timeout=60) as c:
            try:
                c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi."}], extra_body={"session_id": "new"}
                )
            except openai.APIStatusError as e:
                got["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    try:
        h.wait_held()
        ((_, sid),) = h.gw._turns
        status, r = _http(h.base_url, "DELETE", f"/sessions/{sid}", key=None)
        assert status == 200 and r["deleted"], r
        h.release()
        t.join(60)
        e = got["error"]
        assert isinstance(e, openai.ConflictError) and e.status_code == 409, e
        assert e.body["param"] == "session_id" and "closed" in e.body["message"], e.body
    finally:
        h.release()
        h.st.stop()


def test_a_client_that_goes_away_cancels_its_turn(loop_thread, tiny_llama, tok):
    h = Held(loop_thread, tiny_llama, tok)
    try:
        u = urlsplit(h.base_url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Bye."}], "stream": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode())
        h.wait_held()
        assert len(h.gw._turns) == 1
        conn.close()  # before any answer: the handler is cancelled, and the turn with it
        wait_until(lambda: not h.gw._turns, timeout=10, what="the turn cancelled")
        h.release()
        with Client(h.st.gateway, timeout=30) as c:
            assert c.list_sessions() == []  # nothing saved
    finally:
        h.release()
        h.st.stop()


def test_a_one_call_session_saved_just_before_its_client_went_away_is_closed(loop_thread, tiny_llama, tok):
    """The record is written, then the client disconnects before the answer ends: the session it
    can never name again is closed anyway (no record, no quota held)."""
    h = Held(loop_thread, tiny_llama, tok)
    h.release()  # drafters open at once here; the turn is held after its save instead
    saved, gate = asyncio.Event(), asyncio.Event()
    real_save = h.gw.records.save

    async def held_save(rec, *a, **kw):
        await real_save(rec, *a, **kw)
        saved.set()
        await gate.wait()

    h.gw.records.save = held_save
    try:
        u = urlsplit(h.base_url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Bye."}], "stream": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode())
        loop_thread.run(saved.wait())
        with Client(h.st.gateway, timeout=30) as c:
            assert len(c.list_sessions()) == 1  # saved
            conn.close()
            wait_until(lambda: not h.gw._turns, timeout=30, what="the turn cancelled")
            wait_until(lambda: c.list_sessions() == [], timeout=30, what="the one-call session closed")
    finally:
        loop_thread.loop.call_soon_threadsafe(gate.set)
        h.st.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_bug_is_a_500_with_a_log_id(stack, client, monkeypatch, caplog, stream):
    """An unexpected exception (here: saving the record) is logged; the caller gets a server_error
    with its id and nothing of the exception, as a 500 or, once a stream has begun, as an event."""

    async def boom(rec, lease=None):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(stack.gateway_pair[1].records, "save", boom)
    with pytest.raises(openai.APIError) as e:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream, **GREEDY
        )
        if stream:
            list(r)  # the error arrives as an event
    msg = str(e.value)
    assert "internal error (id " in msg and "secret" not in msg
    logged = [r for r in caplog.records if getattr(r, "error_id", None)]  # the traceback, under the id the caller got
    assert logged and f"(id {logged[-1].error_id})" in msg and logged[-1].path == "/v1/chat/completions"
    assert "secret internals" in str(logged[-1].exc_info[1])
    if not stream:
        assert isinstance(e.value, openai.InternalServerError) and e.value.status_code == 500


def test_a_burst_over_the_turns_quota_waits_keeps_its_streams_alive_and_a_full_queue_gets_429(
    loop_thread, tiny_llama, tok, tmp_path
):
    """turns=1 and room for two waiters: a stream that waits gets its status line and an SSE comment
    at once; a call past the queue gets 429 with Retry-After; every waiter is answered in order,
    each as the same prompt alone (greedy)."""
    limits = tmp_path / "limits.toml"
    limits.write_text("[default]\nturns = 1\n")
    h = Held(loop_thread, tiny_llama, tok, tenant_limits=str(limits), queue_max_waiters=2)
    prompts = [[{"role": "user", "content": f"Turn {i}, go."}] for i in range(3)]
    refs = [_text(tok, hf_greedy(tiny_llama, messages_ids(tok, m), N)) for m in prompts]
    out: dict = {}
    try:

        def call(i: int, stream: bool):
            with openai.OpenAI(base_url=h.base_url, api_key="none", max_retries=0, timeout=60) as c:
                r = c.chat.completions.create(model=MODEL, messages=prompts[i], stream=stream, **GREEDY)
                out[i] = (
                    "".join(ch.choices[0].delta.content or "" for ch in r) if stream else r.choices[0].message.content
                )

        threads = [threading.Thread(target=call, args=(0, False), daemon=True)]
        threads[0].start()
        h.wait_held()  # turn 0 holds the tenant's one slot
        u = urlsplit(h.base_url)
        raw = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        body = {"model": MODEL, "messages": prompts[1], "stream": True, **GREEDY}
        raw.request("POST", "/v1/chat/completions", body=json.dumps(body).encode())
        resp = raw.getresponse()  # the status line comes while the turn waits
        assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
        assert resp.readline().startswith(b": queued, 0 ahead")  # a comment: ignored by clients, seen by proxies
        threads.append(threading.Thread(target=call, args=(2, True), daemon=True))  # the openai client, queued
        threads[1].start()
        wait_until(lambda: h.gw.queue.waiting("local") == 2, timeout=30, what="two turns queued")
        req = json.dumps({"model": MODEL, "messages": prompts[0], **GREEDY}).encode()
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=req)
        full = conn.getresponse()
        err = json.loads(full.read())["error"]
        assert full.status == 429 and int(full.getheader("Retry-After")) >= 1, err
        assert "queue_max_waiters=2" in err["message"] and "turns=1" in err["message"]
        h.release()
        events = [line for line in resp.read().split(b"\n") if line.startswith(b"data: {")]
        text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events)
        assert text == refs[1]
        for t in threads:
            t.join(60)
        assert out == {0: refs[0], 2: refs[2]}
        assert h.gw.queue.waiting("local") == 0
    finally:
        h.release()
        h.st.stop()


def test_six_turns_over_a_quota_of_two_all_finish_as_alone_and_another_tenant_goes_first(
    loop_thread, tiny_llama, tok, tmp_path
):
    """Over gRPC: acme's quota is turns=2, its six turns start together (two run, held, four wait);
    globex's one turn is answered while acme's queue is still full; then all six finish, each
    token for token the same prompt alone (greedy)."""
    (tmp_path / "keys").write_text("key-a acme\nkey-b globex\n")
    (tmp_path / "limits.toml").write_text("[tenants.acme]\nturns = 2\n")
    files = dict(api_keys=str(tmp_path / "keys"), tenant_limits=str(tmp_path / "limits.toml"))
    h = Held(loop_thread, tiny_llama, tok, hold=lambda req: req.tenant == "acme", **files)
    prompts = [[7 + i, 9, 11 + i, 13] for i in range(6)]
    refs = [hf_greedy(tiny_llama, p, N) for p in prompts]
    waits = REGISTRY.get_sample_value("racer_queue_wait_seconds_count") or 0
    try:
        with Client(h.st.gateway, api_key="key-a", timeout=60) as a, ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(a.complete, p, max_new_tokens=N) for p in prompts]
            wait_until(lambda: h.gw.queue.waiting("acme") == 4, timeout=30, what="four acme turns queued")
            with Client(h.st.gateway, api_key="key-b", timeout=60) as b:
                assert b.complete([5, 6, 7], max_new_tokens=N)[0] == hf_greedy(tiny_llama, [5, 6, 7], N)
            assert h.gw.queue.waiting("acme") == 4 and not any(f.done() for f in futs)
            h.release()
            assert [f.result(60)[0] for f in futs] == refs
        assert h.gw.queue.waiting("acme") == 0
        assert REGISTRY.get_sample_value("racer_queue_wait_seconds_count") >= waits + 4
    finally:
        h.release()
        h.st.stop()


def test_without_api_keys_no_per_tenant_cap_limits_the_service(stack, loop_thread, tiny_llama, tok):
    """One local tenant: its caps would be the whole service's. With keys they stay as set."""
    gw = stack.gateway_pair[1]
    assert gw.limits.max_sessions_per_tenant == 32 and gw.quotas.limits.of(TENANT).turns == 32
    h = Held(loop_thread, tiny_llama, tok)
    try:
        assert h.gw.limits.max_sessions_per_tenant == 0 and h.gw.quotas.limits.of("local").turns == 0
    finally:
        h.st.stop()


@pytest.mark.parametrize("keys", [False, True], ids=["no-keys", "tenant-sessions-8"])
def test_64_concurrent_one_call_requests_after_10_lone_ones_are_all_answered(
    loop_thread, tiny_llama, tok, tmp_path, redis_url, keys
):
    """One-call sessions (no ``session_id``) count only while they run, never as kept sessions:
    after ten lone requests, 64 streaming requests at once are all answered, each as alone, without
    API keys (the local tenant) and for a tenant whose kept-sessions quota is 8. All 64 are held
    open in the drafter until every one of them is admitted, so they do run at once. Real Redis."""
    # a long lease: 64 turns held on a loaded machine must not lose theirs (what is tested is the quotas)
    gateway = dict(session_url=redis_url, snapshot_url=redis_url, verifier={"max_sessions": 64}, lease_seconds=60.0)
    api_key = "none"
    if keys:
        tenant = f"burst-{uuid.uuid4().hex[:8]}"
        (tmp_path / "keys").write_text(f"key-burst {tenant}\n")
        (tmp_path / "limits.toml").write_text(f"[tenants.{tenant}]\nsessions = 8\nturns = 0\n")
        gateway.update(api_keys=str(tmp_path / "keys"), tenant_limits=str(tmp_path / "limits.toml"))
        gateway.update(max_sessions_per_tenant=0)
        api_key = "key-burst"
    opened = []
    h = Held(loop_thread, tiny_llama, tok, hold=lambda req: opened.append(1) or len(opened) > 10, **gateway)
    prompts = [[{"role": "user", "content": f"Burst {i}: go on."}] for i in range(74)]
    params = {"temperature": 0, "max_tokens": 8}
    refs = [_text(tok, hf_greedy(tiny_llama, messages_ids(tok, m), 8)) for m in prompts]
    out: dict = {}

    def call(i: int):
        with openai.OpenAI(base_url=h.base_url, api_key=api_key, max_retries=0, timeout=120) as c:
            try:
                r = c.chat.completions.create(model=MODEL, messages=prompts[i], stream=True, **params)
                out[i] = "".join(ch.choices[0].delta.content or "" for ch in r)
            except openai.APIError as e:
                out[i] = e

    try:
        for i in range(10):  # lone requests, one after another (not held)
            call(i)
        with ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(call, i) for i in range(10, 74)]
            # every one is admitted and held in the drafter's open, or has failed: then they all go on
            wait_until(lambda: len(opened) + len(out) >= 74, timeout=300, what="the 64 requests admitted")
            h.release()
            for f in futures:
                f.result()
        assert out == {i: refs[i] for i in range(74)}
        assert len(opened) == 74  # all 64 were open at once
        tenant_name = tenant if keys else "local"
        # the answers' last bytes may arrive before their turns' quotas are settled: until they are
        wait_until(
            lambda: loop_thread.run(h.gw.quotas.usage(tenant_name)) == (0, 0, 0),
            timeout=60,
            what="nothing counted once every one-call session ended",
        )
    finally:
        h.release()
        h.st.stop()
