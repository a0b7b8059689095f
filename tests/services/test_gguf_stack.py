"""The bundled model served from its GGUF file's blocks (``--dtype gguf``) through the services: a
racer turn through the gateway emits exactly what the engine's own ``off`` decoding emits in process."""

from __future__ import annotations

import pytest

from common.loop import generate
from common.params import GenerationParams
from common.text import DEFAULT_SYSTEM, chat_ids
from drafter.draft_session import DraftSession
from racer.client import Client
from tests.support.stack import start_stack
from verifier import native
from verifier.engine import VerifierSession

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not native.quant_supported(3), reason=f"native kernels not built: {native.why()}")
def test_a_racer_turn_through_the_stack_equals_off_in_process(loop_thread, monkeypatch):
    from verifier.model import load

    monkeypatch.delenv("RACER_KERNELS", raising=False)
    loaded = load("default", dtype="gguf")
    tok, eos = loaded.tokenizer, loaded.eos_token_ids
    text = "Name three primary colors and say which is warmest."
    prompt = chat_ids(tok, text, DEFAULT_SYSTEM)
    v = VerifierSession(loaded.model, backend="llama")
    assert v.backend.fused is not None
    params = GenerationParams(max_new_tokens=32, mode="off", stop_token_ids=tuple(eos))
    off = [t for c in generate(DraftSession(), v, prompt, params) for t in c]
    st = start_stack(loop_thread, loaded.model, tokenizer=tok, eos_ids=eos)
    try:
        with Client(st.gateway, timeout=300) as c:
            ids, _, _ = c.complete(text, max_new_tokens=32, system=DEFAULT_SYSTEM, budget=16)
        assert ids == off
    finally:
        st.stop()
