"""The bundled model through the services: chat turns from text, and the README's main command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from common.text import DEFAULT_SYSTEM, chat_ids, continue_ids, messages_ids
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.stack import start_stack

pytestmark = pytest.mark.slow


def test_chat_turns_from_text_equal_greedy_on_the_whole_conversation(loop_thread, default_model):
    tok = default_model.tokenizer
    eos = default_model.eos_token_ids
    st = start_stack(  # a fixed budget below: no cost curve to measure (seconds of float32 trees)
        loop_thread,
        default_model.model,
        tokenizer=tok,
        eos_ids=eos,
        http_port=-1,
        served_model_name="smol",
        verifier={"measure_cost": False},
    )
    try:
        turns = ["Name three primary colors.", "Which of them is warmest?"]
        history: list[int] = []
        sid = ""
        with Client(st.gateway, timeout=300) as c:
            for i, text in enumerate(turns):
                ids, streamed, last = c.complete(
                    text, session_id=sid, max_new_tokens=16, system=DEFAULT_SYSTEM, budget=4
                )
                expect_in = (
                    chat_ids(tok, text, DEFAULT_SYSTEM)
                    if i == 0
                    else continue_ids(tok, history, [{"role": "user", "content": text}], eos)
                )
                history += expect_in
                assert ids == hf_greedy(default_model.model, history, 16, eos), f"turn {i}"
                assert streamed == tok.decode(ids, skip_special_tokens=True)
                history += ids
                sid = last.session_id
        # the token-level continuation is what the chat template renders for the whole conversation
        answers = tok.decode(history[len(chat_ids(tok, turns[0], DEFAULT_SYSTEM)) :], skip_special_tokens=False)
        assert "<|im_start|>user\nWhich of them is warmest?<|im_end|>" in answers
        _openai_chat_equals_greedy(st, default_model)
    finally:
        st.stop()


def _openai_chat_equals_greedy(st, default_model):
    """The OpenAI API with the real tokenizer (multi-character tokens, the model's chat template)."""
    import openai

    tok = default_model.tokenizer
    messages = [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": "Name a fruit."}]
    ref = hf_greedy(default_model.model, messages_ids(tok, messages), 16, default_model.eos_token_ids)
    url = f"http://127.0.0.1:{st.gateway_pair[0].http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as c:
        r = c.chat.completions.create(
            model="smol", messages=messages, max_tokens=16, extra_body={"return_token_ids": True}
        )
        chunks = list(c.chat.completions.create(model="smol", messages=messages, max_tokens=16, stream=True))
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content


def test_the_bundled_model_is_one_the_llama_backend_implements(default_model):
    """``--dtype auto`` takes it for a Llama without reading it (verifier.model._BUNDLED_BACKEND)."""
    from verifier.llama import LlamaBackend
    from verifier.model import serving_backend

    assert LlamaBackend.supports(default_model.model) and serving_backend() == "llama"


def test_stack_command_streams_an_answer_and_stops_cleanly(default_model):
    question = "Name three primary colors."
    tok, eos = default_model.tokenizer, default_model.eos_token_ids
    greedy = hf_greedy(default_model.model, chat_ids(tok, question, DEFAULT_SYSTEM), 16, eos)
    # float32 (equal to HF greedy) from the variable, as the services read it: the command's flag,
    # not given, does not override it
    env = dict(os.environ, OMP_NUM_THREADS="1", RACER_DTYPE="float32")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "racer.cli",
            "stack",
            question,
            "--max-new-tokens",
            "16",
            "--any-ports",
            "--http-port",
            "8000",
            "--log-level",
            "INFO",  # the verifier's "model" line says the dtype it serves
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    served = [r for r in map(_record, proc.stderr.splitlines()) if r and r.get("msg") == "model"]
    assert [(r["setting"], r["dtype"]) for r in served] == [("float32", "float32")], proc.stderr[-2000:]
    assert proc.stdout == tok.decode(greedy, skip_special_tokens=True) + "\n", "the answer is not greedy's"
    assert f"tokens={len(greedy)} " in proc.stderr and "MAT=" in proc.stderr
    assert "did not stop" not in proc.stderr
    assert re.search(r"OpenAI API http://127\.0\.0\.1:\d+/v1", proc.stderr)  # in the "stack up" line


def _record(line: str) -> dict | None:
    """A JSON log line of a service, else None."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
