"""Any decoder-only causal LM as the target: every family's racer output is transformers' greedy
output, token for token, on whichever backend the verifier picks for it (llama, hf with tree
verification, or hf with chain verification), and the llama backend claims exactly the
models it computes right."""

from __future__ import annotations

import logging

import pytest
import torch

from common.params import GenerationParams
from tests.support.engine import ScriptedDrafter, hf_greedy, run, run_racer
from tests.support.families import FAMILIES, VOCAB, backend_kind, echo_prompt, make, model
from verifier.engine import VerifierSession
from verifier.hf import HFBackend, chain_of, hf_plan
from verifier.llama import LlamaBackend
from verifier.tree import tree_inputs

N = 24


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_output_is_hf_greedy_at_budgets_1_8_64(name):
    m = model(name)
    assert backend_kind(VerifierSession(m).backend) == FAMILIES[name][2]
    prompt = echo_prompt(m)
    ref = hf_greedy(m, prompt, N)
    assert len(set(ref)) >= 4, f"the tiny {name} model's output is too uniform to test anything: {ref}"
    for budget in (1, 8, 64):
        out, stats, _ = run_racer(m, list(prompt), "auto", max_new_tokens=N, mode="racer", budget=budget)
        assert out == ref, f"budget {budget}"
        if budget == 1:
            assert stats.rounds == N - 1 and stats.drafted == 0
        else:
            assert stats.accepted > 0, f"budget {budget}: no draft accepted, so nothing was verified"
    # Trees that put the right tokens at wrong places and wrong ones on the right path: the cache
    # must keep exactly the accepted rows whatever their offsets (a chain-only model verifies the
    # first path of each).
    truth = prompt + hf_greedy(m, prompt, N + 64)
    for budget in (8, 64):
        drafter = ScriptedDrafter(truth, VOCAB, "near", seed=budget)
        out, stats, _ = run(
            drafter, VerifierSession(m), list(prompt), GenerationParams(max_new_tokens=N, budget=budget)
        )
        assert out == ref, f"near trees, budget {budget}"


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f[2] != "llama"])
def test_hf_tree_logits_equal_sequential_decoding(name):
    """Every node of a random tree, over a context longer than any test window, gets the logits of
    plain decoding of its root path; after the commit the cache continues the accepted path."""
    m = model(name)
    session = VerifierSession(m, backend="hf")
    g = torch.Generator().manual_seed(5)
    context = torch.randint(3, VOCAB, (19,), generator=g).tolist()
    tokens = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 6, 9]
    session.prefill(context)
    if session.backend.chain_only:
        nodes = chain_of(parents)  # [0, 1, 3, 6, 9, 11]
        sub = [tokens[i] for i in nodes]
        positions, mask = tree_inputs([-1, *range(len(nodes) - 1)], session.length)
        logits = session.backend.logits(session.backend.forward(torch.tensor(sub), positions, mask))
        with pytest.raises(ValueError, match=f"model_type='{m.config.model_type}' verifies chains only"):
            session.backend.forward(torch.tensor(tokens), *tree_inputs(parents, session.length + len(nodes)))
        keep = [0, 1, 2]
    else:
        nodes = list(range(len(tokens)))
        positions, mask = tree_inputs(parents, session.length)
        logits = session.backend.logits(session.backend.forward(torch.tensor(tokens), positions, mask))
        keep = [0, 2, 5]
    with torch.inference_mode():
        for row, i in enumerate(nodes):
            path, j = [], i
            while j != -1:
                path.insert(0, tokens[j])
                j = parents[j]
            want = m(torch.tensor([context + path])).logits[0, -1]
            torch.testing.assert_close(logits[row], want, atol=1e-4, rtol=1e-4, msg=f"node {i}")
        session.backend.commit(keep, len(nodes))
        kept = [tokens[nodes[r]] for r in keep]
        hidden = session.backend.forward(torch.tensor([5]), torch.tensor([session.length]), None)
        want = m(torch.tensor([context + kept + [5]])).logits[0, -1]
        torch.testing.assert_close(session.backend.logits(hidden)[0], want, atol=1e-4, rtol=1e-4)


def test_a_chain_only_family_says_so_at_load(caplog):
    m = make("bloom")  # a fresh model object: the probe runs (and logs) again
    with caplog.at_level(logging.WARNING, logger="verifier.hf"):
        session = VerifierSession(m)
    assert session.backend.chain_only
    assert "model_type='bloom' cannot verify trees" in caplog.text and "ALiBi" in caplog.text
    # a tree is verified as its first path: nothing off it is accepted
    session.prefill([3, 4, 5])
    res = session.verify([7, 8, 9, 10, 11], [-1, 0, 0, 1, 2])
    assert set(res.accepted) <= {0, 1, 3} and len(res.topk) == 5


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("mamba", dict(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, state_size=4)),
        (
            "rwkv",
            dict(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, attention_hidden_size=32, intermediate_size=64),
        ),
    ],
)
def test_an_unsupported_family_fails_at_load_naming_its_model_type(model_type, overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **overrides)).eval()
    with pytest.raises(ValueError, match=f"model_type='{model_type}' is not supported by the hf backend"):
        VerifierSession(m)


# -- the llama backend claims what it implements, no more -----------------------------------------------

LLAMA_VARIANTS = {
    "llama": ("llama", {}),
    "llama-biases": ("llama-biases", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", {}),
    "mistral-swa": ("mistral-swa", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-swa": ("qwen2-swa", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-swa": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    "smollm3": ("smollm3", {}),
    "smollm3-nope": ("smollm3-nope", {}),
    "gemma": ("gemma", {}),  # Llama-shaped; its embedding module scales, its norms add 1 to the weight
    "gemma2": ("gemma2", {}),  # soft-capping, sliding windows, extra norms
    # scores unscaled and capped hard (most of them past the cap), so that a cap left out would show
    "gemma2-capped": ("gemma2", dict(attn_logit_softcapping=0.05, query_pre_attn_scalar=1)),
    "gemma3_text": ("gemma3_text", {}),  # q/k norms, local and global layers with their own RoPE bases
    "phi3": ("phi3", {}),  # fused qkv_proj and gate_up_proj
    "phi3-swa": ("phi3", dict(sliding_window=8)),
    "phi3-partial": ("phi3", dict(partial_rotary_factor=0.5)),
    "stablelm": ("stablelm", {}),  # partial rotary, LayerNorm
}


def _llama_computes(m) -> bool:
    """Whether LlamaBackend's tree forward gives transformers' logits (over a context longer
    than the test windows, so that a window it ignored would show)."""
    g = torch.Generator().manual_seed(9)
    context = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    tokens = torch.randint(3, VOCAB, (6,), generator=g).tolist()
    parents = [-1, 0, 0, 1, 2, 4]
    try:
        b = LlamaBackend(m)
        b.forward(torch.tensor(context), torch.arange(20), torch.ones(20, 20, dtype=torch.bool).tril())
        b.commit(None, 20)
        positions, mask = tree_inputs(parents, 20)
        logits = b.logits(b.forward(torch.tensor(tokens), positions, mask))
    except Exception:  # noqa: BLE001 - modules it does not know: it does not implement the model
        return False
    with torch.inference_mode():
        for i, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 4, 5]]):
            want = m(torch.tensor([context + [tokens[j] for j in path]])).logits[0, -1]
            if not torch.allclose(logits[i], want, atol=1e-4, rtol=1e-4):
                return False
    return True


@pytest.mark.parametrize("variant", list(LLAMA_VARIANTS))
def test_llama_supports_agrees_with_what_it_computes(variant):
    family, more = LLAMA_VARIANTS[variant]
    m = make(family, **more)
    claims = LlamaBackend.supports(m)
    assert claims == _llama_computes(m), f"supports() says {claims}"
    assert claims == (
        variant
        in {"llama", "llama-biases", "llama-tied", "mistral", "qwen2", "qwen3", "smollm3", "gemma", "gemma2"}
        | {"gemma2-capped", "gemma3_text", "phi3", "phi3-swa", "phi3-partial"}
    )
    if claims:  # and what it claims is lossless end to end
        prompt = echo_prompt(m)
        out, _, _ = run_racer(m, list(prompt), "llama", max_new_tokens=N, mode="racer", budget=8)
        assert out == hf_greedy(m, prompt, N)
    else:
        with pytest.raises(ValueError, match="llama backend does not support"):
            VerifierSession(m, backend="llama")
    assert isinstance(hf_plan(m), object) and isinstance(VerifierSession(m, backend="hf").backend, HFBackend)


def test_the_hf_backend_refuses_reduced_precision():
    """Its forward is not batch invariant, so a draft could change a bfloat16 output: refused."""
    m = make("gpt2").to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        VerifierSession(m)
