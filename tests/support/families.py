"""Tiny random-weight causal LMs of many ``transformers`` families, built in the test (no downloads).

``make(name)`` builds a seeded float32 model of 2 layers, hidden size 32-64 and a 96-token
vocabulary (the services tests' prompts use ids below 96). As in ``tests.support.models.make_tiny_llama`` the
input and output embeddings are untied and scaled up, so that greedy continuations are varied but
fall into short cycles, like a small LM's: drafts then get accepted and trees are exercised.
"""

from __future__ import annotations

import functools

import torch

VOCAB = 96

# Sizes every family understands under one of its own names (only the names a config has are set).
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    n_embd=64,
    d_model=64,
    intermediate_size=128,
    ffn_dim=128,
    n_inner=128,
    num_hidden_layers=2,
    n_layer=2,
    num_layers=2,
    n_layers=2,
    num_attention_heads=4,
    n_head=4,
    num_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    n_positions=512,
    n_ctx=512,
    head_dim=16,
    word_embed_proj_dim=64,
    rotary_dim=8,
    tie_word_embeddings=False,
)

# name -> (model_type, config overrides, backend the verifier picks: "llama", "hf"
# or "chain" (hf, verifying chains only)[, {seed, embed_scale}])
FAMILIES = {
    "llama": ("llama", {}, "llama"),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True), "llama"),
    "mistral": ("mistral", dict(sliding_window=None), "llama"),
    "mistral-swa": ("mistral", dict(sliding_window=8), "hf"),
    "qwen2": ("qwen2", {}, "llama"),
    "qwen2-swa": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "hf"),
    "qwen3": ("qwen3", {}, "llama"),
    "smollm3": ("smollm3", {}, "llama"),
    "smollm3-nope": ("smollm3", dict(num_hidden_layers=4), "hf"),  # layer 4 skips RoPE
    "gpt2": ("gpt2", {}, "hf"),
    "gpt_neox": ("gpt_neox", {}, "hf"),
    "opt": ("opt", {}, "hf"),
    "falcon": ("falcon", {}, "hf"),
    "falcon-alibi": ("falcon", dict(alibi=True), "chain", dict(seed=2)),
    "bloom": ("bloom", {}, "chain"),
    "gptj": ("gptj", {}, "hf"),
    "phi": ("phi", {}, "hf", dict(embed_scale=8.0)),
    "phi3": ("phi3", {}, "hf"),
    "gemma": ("gemma", {}, "llama"),
    "gemma2": ("gemma2", dict(sliding_window=8), "hf"),
    "stablelm": ("stablelm", {}, "hf"),
    "mpt": ("mpt", {}, "chain"),
    "gpt_bigcode": ("gpt_bigcode", {}, "hf"),
    "codegen": ("codegen", {}, "hf", dict(embed_scale=4.0)),
    "starcoder2": ("starcoder2", dict(sliding_window=8), "hf"),
    "olmo2": ("olmo2", {}, "hf", dict(seed=1, embed_scale=4.0)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=8), "hf"),
    "granite": ("granite", {}, "hf"),
    "cohere": ("cohere", {}, "hf"),
    "persimmon": ("persimmon", {}, "hf"),
}


def make(name: str, seed: int | None = None, **more):
    """``more``: config overrides on top of the family's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides, _, *opts = FAMILIES[name]
    opts = opts[0] if opts else {}
    seed = opts.get("seed", 0) if seed is None else seed
    base = AutoConfig.for_model(model_type)
    kw = {
        k: v for k, v in _SMALL.items() if hasattr(base, k) and not isinstance(getattr(type(base), k, None), property)
    }
    kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    kw.update(more)
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(opts.get("embed_scale", 2.0))
        head = model.get_output_embeddings()
        if head.weight is not model.get_input_embeddings().weight:
            head.weight.mul_(16.0)
    return model


def backend_kind(backend) -> str:
    from verifier.llama import LlamaBackend

    if isinstance(backend, LlamaBackend):
        return "llama"
    return "chain" if backend.chain_only else "hf"


@functools.lru_cache(maxsize=None)
def model(name: str):
    """``make(name)``, built once per test process (the tests only read it)."""
    return make(name)


def echo_prompt(m, n: int = 20) -> list[int]:
    """A prompt that holds a stretch of its own greedy continuation: retrieval drafts find it."""
    from tests.support.engine import hf_greedy

    base = [3, 7, 11]
    return base + hf_greedy(m, base, n)
