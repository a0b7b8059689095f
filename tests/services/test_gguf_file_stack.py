"""A user's own GGUF file (a tiny random Qwen2, written as llama.cpp writes it) served from its
blocks through the services: a racer turn through the gateway emits exactly what the engine's own
``off`` decoding emits in process, the prompt rendered by the file's chat template."""

from __future__ import annotations

import pytest

from common.loop import generate
from common.params import GenerationParams
from common.text import DEFAULT_SYSTEM, chat_ids
from drafter.draft_session import DraftSession
from racer.client import Client
from tests.support.gguf_models import write
from tests.support.stack import start_stack
from verifier import native
from verifier.engine import VerifierSession

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not native.quant_supported(8), reason=f"native kernels not built: {native.why()}")
def test_a_racer_turn_on_a_gguf_file_through_the_stack_equals_off_in_process(loop_thread, monkeypatch, tmp_path):
    from verifier import gguf_blocks
    from verifier.model import load

    monkeypatch.setenv("RACER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RACER_KERNELS", raising=False)
    path = write(tmp_path / "qwen2.gguf", "qwen2", "Q8_0")
    loaded = load(str(path), dtype="auto")
    assert gguf_blocks.kept(loaded.model)["dequantized"] == {}
    tok, eos = loaded.tokenizer, loaded.eos_token_ids
    text = "Name three primary colors and say which is warmest."
    prompt = chat_ids(tok, text, DEFAULT_SYSTEM)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")  # the file's template
    v = VerifierSession(loaded.model, backend="llama")
    assert v.backend.fused is not None
    params = GenerationParams(max_new_tokens=32, mode="off", stop_token_ids=tuple(eos))
    off = [t for c in generate(DraftSession(), v, prompt, params) for t in c]
    st = start_stack(loop_thread, loaded.model, tokenizer=tok, eos_ids=eos, verifier={"measure_cost": False})
    try:
        with Client(st.gateway, timeout=300) as c:
            ids, _, _ = c.complete(text, max_new_tokens=32, system=DEFAULT_SYSTEM, budget=16)
        assert ids == off
    finally:
        st.stop()
