"""A base model (its tokenizer has no chat template) is served: completions and token ids continue
text, chat is refused with a 400 / INVALID_ARGUMENT that names ``--chat-template``, and with the
operator's template the same model serves chat. ``racer stack`` on such a model continues its prompt
as text. The tiny Llama with a character-level tokenizer, every answer compared with greedy decoding."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from urllib.parse import urlsplit

import grpc
import pytest

from common.text import messages_ids, text_ids
from gateway.tools import NO_CHAT_TEMPLATE
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.stack import start_stack
from tests.support.tinytok import TEMPLATE, make_char_tokenizer

N = 12
MODEL = "tiny-base"
PROMPT = "Once upon a time, a model"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer(chat=False)


def _stack(loop_thread, tiny_llama, tok, **gateway):
    return start_stack(
        loop_thread, tiny_llama, tokenizer=tok, eos_ids=(), http_port=-1, served_model_name=MODEL, **gateway
    )


@pytest.fixture(scope="module")
def base(loop_thread, tiny_llama, tok):
    st = _stack(loop_thread, tiny_llama, tok)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def templated(loop_thread, tiny_llama, tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(TEMPLATE)
    st = _stack(loop_thread, tiny_llama, tok, chat_template=str(path))
    yield st
    st.stop()


def _post(st, path: str, body: dict) -> tuple[int, dict]:
    u = urlsplit(f"http://127.0.0.1:{st.gateway_pair[0].http_port}")
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _refused(status: int, body: dict, param: str | None) -> None:
    assert status == 400, body
    err = body["error"]
    assert err["message"] == NO_CHAT_TEMPLATE
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, "invalid_argument")


def test_the_message_names_completions_and_the_setting():
    assert "no chat template" in NO_CHAT_TEMPLATE and "/v1/completions" in NO_CHAT_TEMPLATE
    assert "--chat-template" in NO_CHAT_TEMPLATE and "RACER_CHAT_TEMPLATE" in NO_CHAT_TEMPLATE


@pytest.mark.parametrize("stream", [False, True])
def test_chat_to_a_base_model_is_a_400_naming_chat_template(base, stream):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": N, "stream": stream}
    _refused(*_post(base, "/v1/chat/completions", body), "messages")
    # (the Responses API names no param for its input's errors)
    _refused(*_post(base, "/v1/responses", {"model": MODEL, "input": "Hello", "stream": stream}), None)


def test_completions_of_a_base_model_continue_the_text(base, tok, tiny_llama):
    ref = hf_greedy(tiny_llama, text_ids(tok, PROMPT), N)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "return_token_ids": True}
    status, r = _post(base, "/v1/completions", body)
    assert status == 200, r
    assert r["choices"][0]["token_ids"] == ref
    assert r["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)


def test_grpc_chat_forms_are_invalid_argument_and_token_ids_are_served(base, tok, tiny_llama):
    with Client(base.gateway, timeout=60) as c:
        for prompt, system in ((PROMPT, "Be brief."), (PROMPT, ""), (MESSAGES, "")):
            with pytest.raises(grpc.RpcError) as e:
                c.complete(prompt, system=system, max_new_tokens=N)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == NO_CHAT_TEMPLATE
        ids = text_ids(tok, PROMPT)
        assert c.complete(ids, max_new_tokens=N)[0] == hf_greedy(tiny_llama, ids, N)


def test_with_the_operators_template_the_base_model_serves_chat(templated, tok, tiny_llama):
    ref = hf_greedy(tiny_llama, messages_ids(tok, MESSAGES, chat_template=TEMPLATE), N)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": N, "temperature": 0, "return_token_ids": True}
    status, r = _post(templated, "/v1/chat/completions", body)
    assert status == 200, r
    assert r["choices"][0]["token_ids"] == ref
    with Client(templated.gateway, timeout=60) as c:
        assert c.complete(MESSAGES, max_new_tokens=N)[0] == ref
        # one user message with a system prompt: the operator's template too
        assert c.complete("Hello there!", system="Be brief.", max_new_tokens=N)[0] == ref


def _cli_on_base_model(tmp_path, tok, tiny_llama, command: str, *flags: str, **env_more):
    """``racer COMMAND PROMPT --model DIR ...`` on the base model saved in ``tmp_path``: (the model's
    path, the process, what greedy decoding continues the prompt's text with)."""
    model = tmp_path / "base-model"
    tiny_llama.save_pretrained(model)
    tok.save_pretrained(model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")}
    env.update(RACER_THREADS="1", OMP_NUM_THREADS="1", **env_more)
    argv = [command, PROMPT, "--model", str(model), "--max-new-tokens", str(N), "--budget", "4", *flags]
    proc = subprocess.run(
        [sys.executable, "-m", "racer.cli", *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = hf_greedy(tiny_llama, text_ids(tok, PROMPT), N, eos=(tiny_llama.config.eos_token_id,))
    assert proc.stdout == tok.decode(ref, skip_special_tokens=True) + "\n"
    return model, proc, ref


def _said(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "no chat template" in line]


def test_racer_stack_continues_a_base_models_prompt_as_text(tmp_path, tok, tiny_llama):
    model, proc, ref = _cli_on_base_model(
        tmp_path, tok, tiny_llama, "stack", "--no-pin", "--any-ports", "--http-port", "0",
        RACER_MEASURE_COST="0", RACER_DTYPE="float32",
    )  # fmt: skip
    assert _said(proc) == [f"racer: {model} has no chat template, so the prompt is continued as text "
                           "(--chat-template FILE gives it one)"]  # fmt: skip
    assert f" tokens={len(ref)} " in proc.stderr and "MAT=" in proc.stderr  # the stats line
    assert "did not stop" not in proc.stderr


def test_the_stack_sends_text_only_for_a_model_without_a_template(tmp_path, tok, tiny_llama):
    from racer.stack import text_prompt

    base, chat = tmp_path / "base", tmp_path / "chat"
    for path, t in ((base, tok), (chat, make_char_tokenizer())):
        tiny_llama.config.save_pretrained(path)
        t.save_pretrained(path)
    assert text_prompt(str(base), PROMPT) == text_ids(tok, PROMPT)
    assert text_prompt(str(base), PROMPT, chat_template="chatml.jinja") is None  # the operator's
    assert text_prompt(str(chat), PROMPT) is None


def test_racer_generate_continues_a_base_models_prompt_as_text(tmp_path, tok, tiny_llama):
    """In one process too: no chat template applied to a base model's prompt, and said once."""
    model, proc, _ = _cli_on_base_model(tmp_path, tok, tiny_llama, "generate", "--no-prior", "--dtype", "float32")
    assert _said(proc) == [f"racer: {model} has no chat template, so the prompt is continued as text"]
