"""A user's own GGUF file as ``--model``: tiny random models of each family the llama backend serves,
written as llama.cpp writes them (``tests/support/gguf_models.py``), converted once and served from
their blocks (Phi-3's fused q/k/v and gate/up weights as one each; Gemma 2/3 past their sliding
windows); the chat template is the file's; a family the llama backend does not serve falls back to
the hf backend in float32 with one log line; a directory with one GGUF file serves it.
"""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from racer.bench.reference import hf_greedy
from tests.support.gguf_models import bundled_tokenizer, write
from verifier import gguf_blocks, native
from verifier.layouts import layer_projections
from verifier.model import gguf_source, load, resolve_dtype, resolve_model_dir

pytestmark = pytest.mark.slow  # each file is written and converted once

needs_kernel = pytest.mark.skipif(not native.quant_supported(3), reason=f"native kernels not built: {native.why()}")

# family -> (projections' format, tied output layer)
SERVED = {
    "llama": ("Q4_0", False),
    "mistral": ("Q4_1", False),
    "qwen2": ("Q8_0", False),
    "qwen3": ("Q4_1", True),
    "gemma2": ("Q5_0", True),  # llama.cpp writes a Gemma 2 without an output layer
    "gemma3_text": ("Q4_1", False),
    "phi3": ("Q4_0", False),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``files(family, fmt, template, tied)``: the GGUF file, written once per module, its conversion
    cached in the module's own cache."""
    root = tmp_path_factory.mktemp("gguf-models")
    mp = pytest.MonkeyPatch()
    mp.setenv("RACER_CACHE", str(root / "cache"))
    mp.delenv("RACER_KERNELS", raising=False)

    @functools.lru_cache(maxsize=None)
    def get(family: str, fmt: str = "Q8_0", template: bool | str = True, tied: bool = False):
        name = f"{family}-{fmt}-{'t' if template is True else 'c' if template else 'n'}{'-tied' if tied else ''}"
        return write(root / f"{name}.gguf", family, fmt, template, tied)

    yield get
    mp.undo()


def _generate(model, prompt: list[int], mode: str, budget: int, n: int) -> list[int]:
    from common.loop import generate
    from common.params import GenerationParams
    from drafter.draft_session import DraftSession
    from verifier.engine import VerifierSession

    v = VerifierSession(model, backend="llama")
    params = GenerationParams(max_new_tokens=n, mode=mode, budget=budget)
    return [t for c in generate(DraftSession(), v, prompt, params) for t in c]


@needs_kernel
@pytest.mark.parametrize("family", sorted(SERVED))
def test_a_gguf_file_is_served_from_its_blocks_and_racer_equals_off(files, family):
    fmt, tied = SERVED[family]
    path = files(family, fmt, tied=tied)
    assert gguf_source(str(path)) == path
    assert resolve_dtype("auto", "cpu", str(path)) == "gguf"
    m = load(str(path), "auto").model
    assert m._racer_gguf_file == str(path)
    held = gguf_blocks.kept(m)
    per_layer = 4 if family == "phi3" else 7  # Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj
    assert all(len(layer_projections(layer)) == per_layer for layer in m.model.layers)
    assert held["dequantized"] == {} and held["blocks"] == {fmt: 2 * per_layer + 1}
    assert m.config.tie_word_embeddings == tied
    # the blocks hold the values the float32 model holds, q and k rows in the model's order
    for layer in m.model.layers:
        for mod in layer_projections(layer):
            assert torch.equal(mod.racer_blocks.rows(torch.arange(mod.weight.shape[0])), mod.weight), mod
    ids = torch.arange(0, m.config.vocab_size, 97)
    assert torch.equal(m.lm_head.racer_blocks.rows(ids), m.lm_head.weight[ids])

    # The forward reads the blocks, biases added (the native decoder's, or op by op for Qwen3's q/k
    # norms): the model's own float32 forward within the 8-bit activations' rounding (about 1% of the
    # largest logit here; a missed Qwen2 bias: over 100%), and farther from it than float32 rounding
    # (under 1e-6) would be.
    from verifier.engine import VerifierSession

    prompt = [5, 900, 77, 4031, 12, 305, 2048, 9]
    s = VerifierSession(m, backend="llama")
    # every layer in one native call where the decoder computes what the family's layers do (Qwen3's
    # per-head q/k norms, Gemma 3's sandwich norms, GELU, local and global layers, Phi-3's fused weights
    # as row ranges of their blocks included, Gemma 2's soft-capped attention scores too)
    assert s.backend.fused is not None, family
    s.prefill(prompt[:-1])
    ids_, positions, mask = s._inputs(prompt[-1:], [-1])
    got = s.backend.logits(s.backend.forward(ids_, positions, mask))[0]
    with torch.no_grad():
        ref = m(torch.tensor([prompt])).logits[0, -1]
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert 1e-4 < err < 0.05, err
    # Weights served from blocks keep no float32 copy in the weight arena (the converted file's
    # mapping, never paged in, holds them); the embedding, norms and biases are packed as before.
    from verifier import arena

    if arena.enabled():
        assert arena.packed(m)
        for layer in m.model.layers:
            assert all(arena.slot(mod.weight) is None for mod in layer_projections(layer))
            assert arena.slot(layer.input_layernorm.weight) is not None
        assert arena.slot(m.model.embed_tokens.weight) is not None  # its lookups read it, tied or not
        assert (arena.slot(m.lm_head.weight) is None) == (not tied)

    base = _generate(m, prompt, "off", 1, 12)
    echo = prompt + base + prompt  # the prompt holds its own continuation: drafts get accepted
    assert len(echo) > 3 * (getattr(m.config, "sliding_window", None) or 0)  # past the window
    off = _generate(m, echo, "off", 1, 24)
    for budget in (1, 16, 64):
        assert _generate(m, echo, "racer", budget, 24) == off, budget


@pytest.mark.parametrize("family", sorted(SERVED))
def test_the_float32_path_on_the_same_file_equals_hugging_face_greedy(files, family):
    fmt, tied = SERVED[family]
    loaded = load(str(files(family, fmt, tied=tied)), "float32")
    m = loaded.model
    assert getattr(m, "_racer_gguf_file", None) is None and m.dtype == torch.float32
    prompt = [5, 900, 77, 4031, 12, 305, 2048, 9]
    base = hf_greedy(m, prompt, 12)
    echo = prompt + base + prompt
    ref = hf_greedy(m, echo, 24)
    assert _generate(m, echo, "racer", 16, 24) == ref


def test_the_chat_template_the_eos_ids_and_the_context_length_come_from_the_file(files):
    loaded = load(str(files("llama")), "float32")
    assert loaded.tokenizer.chat_template == bundled_tokenizer()["tokenizer.chat_template"]
    assert loaded.eos_token_ids == (bundled_tokenizer()["tokenizer.ggml.eos_token_id"],)
    assert loaded.model.config.max_position_embeddings == 512  # the file's llama.context_length
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n")

    mine = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    custom = load(str(files("llama", template=mine)), "float32", backend="llama").tokenizer
    assert custom.chat_template == mine
    assert custom.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"


def test_a_file_without_a_chat_template_gives_a_tokenizer_without_one(files):
    from transformers import AutoTokenizer

    path = files("llama", template=False)
    assert load(str(path), "float32").tokenizer.chat_template is None
    assert AutoTokenizer.from_pretrained(resolve_model_dir(str(path))).chat_template is None


def test_a_family_the_llama_backend_does_not_serve_falls_back_to_hf_in_float32_with_one_log_line(files, caplog):
    from verifier.engine import backend_for

    path = str(files("starcoder2"))
    for dtype in ("auto", "gguf"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="verifier.model"):
            loaded = load(path, dtype)
        lines = [r.getMessage() for r in caplog.records if r.name == "verifier.model"]
        assert lines == [
            "starcoder2: fused or differently shaped projections; served by the hf backend in float32 "
            "from dequantized weights"
        ]
        assert loaded.model.dtype == torch.float32 and getattr(loaded.model, "_racer_gguf_file", None) is None
        assert backend_for(loaded.model) == "hf"
    # --backend hf asked for: the same, and the line says so
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verifier.model"):
        assert resolve_dtype("gguf", "cpu", str(files("llama")), "hf") == "float32"
    assert [r.getMessage() for r in caplog.records] == [
        "llama: --backend hf; served by the hf backend in float32 from dequantized weights"
    ]


def test_a_directory_with_one_gguf_file_serves_it_and_one_with_two_says_which(files, tmp_path):
    path = files("llama")
    one = tmp_path / "one"
    one.mkdir()
    os.symlink(path, one / "model.gguf")
    assert gguf_source(str(one)) == one / "model.gguf"
    assert resolve_model_dir(str(one)) == resolve_model_dir(str(path))  # the same file: the same cache
    assert load(str(one), "float32").tokenizer.chat_template is not None

    two = tmp_path / "two"
    two.mkdir()
    os.symlink(path, two / "a.gguf")
    os.symlink(path, two / "b.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\): pass the one to serve as --model"):
        resolve_model_dir(str(two))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_dir(str(tmp_path))  # neither a model directory nor one with a GGUF file


def test_gguf_dtype_is_refused_for_a_hugging_face_directory(tmp_path):
    from racer.bench.tiny import make

    make("llama").save_pretrained(tmp_path)
    assert gguf_source(str(tmp_path)) is None
    with pytest.raises(ValueError, match="is a Hugging Face directory"):
        load(str(tmp_path), "gguf", tokenizer=False)
