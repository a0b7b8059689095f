"""Gemma 2, Gemma 3 and Phi-3 on the llama backend: sliding windows per layer (past the window, in
trees whose paths cross it), Gemma 2's soft-capped scores and logits, Gemma 3's local and global
rotary tables, Phi-3's fused projections. In float32 the output is Hugging Face greedy decoding; in
reduced precision a row's bits are those of its one-token step, so racer equals ``off``. What the
backend does not implement goes to the hf backend, with the reason."""

from __future__ import annotations

import random
import re

import pytest
import torch

from racer.bench.tiny import VOCAB, make
from tests.support.engine import hf_greedy, run_racer
from verifier import native
from verifier.engine import VerifierSession
from verifier.hf import HFBackend
from verifier.llama import LlamaBackend, _windowed, forward_segments
from verifier.tree import tree_inputs

WINDOW = 8
# name -> (family, config overrides): each with sliding-window layers of WINDOW keys
VARIANTS = {
    "gemma2": ("gemma2", {}),  # local and global layers alternating, capped scores and logits
    # scores unscaled and capped hard, so that the cap changes them
    "gemma2-capped": ("gemma2", dict(attn_logit_softcapping=0.05, query_pre_attn_scalar=1)),
    "gemma3_text": ("gemma3_text", {}),  # a local layer (base 10,000) and a global one (1,000,000)
    "phi3-swa": ("phi3", dict(sliding_window=WINDOW)),  # one window on every layer
    "phi3-partial": ("phi3", dict(sliding_window=WINDOW, partial_rotary_factor=0.5)),
}
WIDE = dict(hidden_size=256, head_dim=64, intermediate_size=512)  # SmolLM2's head size


def _model(name: str, **more):
    family, overrides = VARIANTS[name]
    return make(family, **{**overrides, **more})


def _path(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def _deep_tree(rng: random.Random, n: int) -> list[int]:
    """Parents of a tree whose paths run deeper than the window (most nodes continue the previous
    one, a few branch off earlier)."""
    return [-1] + [i - 1 if rng.random() < 0.75 else rng.randrange(i) for i in range(1, n)]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_float32_output_is_hf_greedy_past_the_window(name):
    m = _model(name)
    assert LlamaBackend.supports(m) and isinstance(VerifierSession(m).backend, LlamaBackend)
    assert WINDOW in LlamaBackend(m).windows
    prompt = [3, 7, 11] + hf_greedy(m, [3, 7, 11], 21)  # holds a stretch of its own continuation
    ref = hf_greedy(m, prompt, 40)
    assert len(set(ref)) >= 4, ref
    assert len(prompt) > 2 * WINDOW
    for mode, budget in (("off", 1), ("racer", 8), ("racer", 64)):
        out, stats, _ = run_racer(m, list(prompt), "llama", max_new_tokens=40, mode=mode, budget=budget)
        assert out == ref, (mode, budget)
        if budget > 1:
            assert stats.accepted > 0


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tree_logits_where_the_window_cuts_into_a_nodes_own_path(name):
    """A short context and a tree deeper than the window: a deep node's window holds only its own
    ancestors, counted by position along its path (not by cache row), and each node's logits are
    the model's own forward over its path."""
    m = _model(name)
    rng = random.Random(3)
    context = [rng.randrange(3, VOCAB) for _ in range(5)]
    parents = _deep_tree(rng, 24)
    tokens = [rng.randrange(3, VOCAB) for _ in parents]
    assert max(len(_path(parents, i)) for i in range(24)) > WINDOW + 2
    b = LlamaBackend(m)
    b.forward(torch.tensor(context), torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril())
    b.commit(None, 5)
    positions, mask = tree_inputs(parents, 5)
    logits = b.logits(b.forward(torch.tensor(tokens), positions, mask))
    with torch.inference_mode():
        for i in range(24):
            want = m(torch.tensor([context + [tokens[j] for j in _path(parents, i)]])).logits[0, -1]
            torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4, msg=f"node {i}")
    # the accepted path's rows kept: the next step continues it
    keep = _path(parents, 23)
    b.commit(keep, 24)
    got = b.logits(b.forward(torch.tensor([5]), torch.tensor([b.length]), None))[0]
    with torch.inference_mode():
        want = m(torch.tensor([context + [tokens[j] for j in keep] + [5]])).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_windowed_mask_keeps_the_keys_within_the_window_of_each_nodes_own_path():
    """Brute force: row r sees key k where the tree lets it and position(k) > position(r) - window,
    the committed rows standing at positions 0, 1, ... and the new ones at their depths."""
    rng = random.Random(4)
    past = 6
    parents = _deep_tree(rng, 14)
    positions, mask = tree_inputs(parents, past)
    got = _windowed(mask, past, positions, 4)
    key_pos = list(range(past)) + positions.tolist()
    for r in range(14):
        p = positions[r].item()
        for k in range(past + 14):
            assert got[r, k].item() == (bool(mask[r, k]) and key_pos[k] > p - 4), (r, k)
    # a node at depth d past the window sees its last 4 positions: itself and 3 ancestors
    deep = max(range(14), key=lambda i: len(_path(parents, i)))
    seen = got[deep].nonzero()[:, 0].tolist()
    assert seen == [past + j for j in _path(parents, deep)[-4:]]
    # a one-token step (no mask): the window alone
    step = _windowed(None, 20, torch.tensor([20]), 4)
    assert step[0].nonzero()[:, 0].tolist() == [17, 18, 19, 20]


@pytest.fixture
def forced(monkeypatch, tmp_path):
    monkeypatch.setenv("RACER_KERNELS", "linear:4")  # 4-row chunks: row invariant, a 1-row step pads
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))


def _session(m, prompt):
    s = VerifierSession(m, backend="llama")
    s.prefill(prompt)
    return s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_reduced_precision_tree_rows_are_their_one_token_steps_past_the_window(forced, name, dtype):
    m = _model(name, **WIDE).to(dtype)
    b = VerifierSession(m, backend="llama").backend
    assert b.invariant
    # the native kernel where it is built (soft-capped scores on its vector path); else torch's, each row alone
    capped = name.startswith("gemma2")
    usable = native.attention_usable(dtype, torch.device("cpu"), 64)
    vector = usable and native.attention_path(dtype, b.n_heads, b.n_kv, b.head_dim) == "vector"
    assert b.native_attention == (usable and (vector or not capped))
    rng = random.Random(0)
    prompt = [rng.randrange(3, VOCAB) for _ in range(12)]
    parents = _deep_tree(rng, 24)
    tokens = [rng.randrange(3, VOCAB) for _ in parents]
    s = _session(m, prompt)
    tree = s.backend.forward(*s._inputs(tokens, parents))
    tree_logits = s.backend.logits(tree)

    # the same tree beside another session's, in one forward
    other = _session(m, [rng.randrange(3, VOCAB) for _ in range(30)])
    mine = _session(m, prompt)
    segs = [(x.backend, *x._inputs(tk, pa)) for x, tk, pa in ((other, [5, 6, 7], [-1, 0, 0]), (mine, tokens, parents))]
    assert torch.equal(forward_segments(segs)[1], tree)

    for i in range(0, 24, 3):
        step = _session(m, prompt)
        for j in _path(parents, i):
            hidden = step.backend.forward(*step._inputs([tokens[j]], [-1]))
            step.backend.commit(None, 1)
        assert torch.equal(hidden[0], tree[i]), f"node {i}, depth {len(_path(parents, i)) - 1}"
        assert torch.equal(step.backend.logits(hidden)[0], tree_logits[i])


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "phi3-swa"])
def test_racer_equals_off_in_bfloat16_past_the_window(forced, name):
    m = _model(name).to(torch.bfloat16)
    prompt = [3, 7, 11] + hf_greedy(_model(name), [3, 7, 11], 21)
    off, _, _ = run_racer(m, list(prompt), "llama", max_new_tokens=40, mode="off", budget=1)
    assert len(off) == 40
    for budget in (8, 64):
        out, stats, _ = run_racer(m, list(prompt), "llama", max_new_tokens=40, mode="racer", budget=budget)
        assert out == off, budget
        assert stats.accepted > 0


def _longrope_phi3():
    return make(
        "phi3",
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
        },
        original_max_position_embeddings=64,
    )


@pytest.mark.parametrize(
    "build, why, hf_verifies",
    [
        (_longrope_phi3, "longrope RoPE scaling (frequencies that depend on the sequence's length)", True),
        # not causal within its windows: the hf backend refuses it too (at load, naming it)
        (lambda: make("gemma3_text", use_bidirectional_attention=True), "bidirectional attention", False),
        (lambda: make("mistral-swa"), "sliding-window layers", True),
    ],
)
def test_what_the_llama_backend_does_not_implement_goes_to_hf_with_the_reason(build, why, hf_verifies, tmp_path):
    from verifier.engine import backend_for
    from verifier.model import _serving

    m = build()
    assert LlamaBackend.unsupported(m) == why
    assert backend_for(m) == "hf"
    if hf_verifies:
        assert isinstance(VerifierSession(m).backend, HFBackend)
    with pytest.raises(ValueError, match=re.escape(f"does not support model_type='{m.config.model_type}': {why}")):
        VerifierSession(m, backend="llama")
    m.save_pretrained(tmp_path)
    assert _serving(str(tmp_path), "auto") == ("hf", why)


@pytest.mark.parametrize("name", ["gemma2", "gemma2-capped", "gemma3_text", "phi3-swa", "phi3-partial"])
def test_the_native_decoder_is_the_models_forward_past_the_window(monkeypatch, tmp_path, name):
    """Every layer in one native call (bfloat16, a widening native tile): Gemma 2's soft-capped
    attention scores (the model's default cap, and one so tight that every score is bent), sandwich
    norms and alternating local and global layers; Gemma 3's sandwich norms (1 + weight), per-head q/k
    norms, GELU, and local layers over their window with their own rotary table; Phi-3's fused q/k/v
    and gate/up weights as row ranges, every layer over its window, rotary over whole heads or (a
    partial rotary factor) over their first half. Each
    node of a tree deeper than the window gets the float32 model's own logits over its path, within
    bfloat16's rounding; its rows are its one-token steps'."""
    from tests.verifier.test_native_decoder import _widening_native

    tile = _widening_native()
    if tile is None or not native.attention_usable(torch.bfloat16, torch.device("cpu"), 64):
        pytest.skip(f"native kernels not built here: {native.why()}")
    monkeypatch.setenv("RACER_KERNELS", tile)
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    ref = _model(name, **WIDE)
    m = _model(name, **WIDE).to(torch.bfloat16)
    assert len(set(LlamaBackend(m).rope_kinds)) == (2 if name == "gemma3_text" else 1)
    assert WINDOW in LlamaBackend(m).windows
    rng = random.Random(5)
    context = [rng.randrange(3, VOCAB) for _ in range(5)]
    parents = _deep_tree(rng, 24)
    tokens = [rng.randrange(3, VOCAB) for _ in parents]
    s = _session(m, context)
    assert s.backend.fused is not None
    tree = s.backend.forward(*s._inputs(tokens, parents))
    logits = s.backend.logits(tree).float()
    with torch.inference_mode():
        for i in range(0, 24, 2):
            path = _path(parents, i)
            want = ref(torch.tensor([context + [tokens[j] for j in path]])).logits[0, -1]
            err = ((logits[i] - want).abs().max() / want.abs().max()).item()
            assert err < 0.02, (i, len(path), err)
    deep = max(range(24), key=lambda i: len(_path(parents, i)))
    step = _session(m, context)
    for j in _path(parents, deep):
        hidden = step.backend.forward(*step._inputs([tokens[j]], [-1]))
        step.backend.commit(None, 1)
    assert torch.equal(hidden[0], tree[deep])
