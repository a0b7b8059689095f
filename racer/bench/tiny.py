"""Tiny random-weight models and random inputs, built in the process (nothing is downloaded): what the
tests and the benchmark scripts that measure the pipeline's own cost (or every family's) run on.

``make_tiny_llama``: a seeded Llama of 2 layers and a 96-token vocabulary. ``make(name)``: a model of
the same size of one of many ``transformers`` families (``FAMILIES``: name -> its model type, its
config overrides, and the backend the verifier picks). Their input and output embeddings are untied
and scaled up, so that greedy continuations are varied but fall into short cycles, like a small LM's:
drafts then get accepted and trees are exercised.

One intra-op thread (``single_thread``): a forward of the tiny Llama takes ~1 ms, and with two OpenMP
threads on a busy two-core machine the threads' spin-waits make every op 5-20x slower (the default
model too: 48 tokens of SmolLM2-135M took 6 s with one thread vs 30 s with two while the other core
was busy). One thread costs at most ~1.6x on an idle machine.
"""

from __future__ import annotations

import contextlib
import random

import torch


@contextlib.contextmanager
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_tiny_llama(seed: int = 0, vocab_size: int = 96, layers: int = 2, hidden: int = 64):
    """``hidden``: 64 gives 16-wide heads (4 heads); 256 gives SmolLM2's 64-wide ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        # Untied: with a tied random output matrix the residual stream is dominated by the input
        # embedding, so every position's argmax is its own token (greedy output = the last prompt
        # token forever, at any embedding scale).
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    # Sharpen the random model's distributions so greedy paths are not near-ties: the embedding
    # scale keeps the context visible through the layers, the output scale gives top-1
    # probabilities of ~0.3. Greedy continuations then wander through several tokens and fall
    # into short cycles (60 greedy tokens: ~10-20 distinct), like a small LM.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
        model.lm_head.weight.mul_(16.0)
    model.eval()
    return model


def prompt(seed: int, n: int = 12, vocab: int = 96) -> list[int]:
    """``n`` reproducible token ids in [3, vocab): the tiny models' vocabulary, past its specials."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def random_tree(rng: random.Random, past: int, n: int) -> tuple[torch.Tensor, list[int]]:
    """(mask [n, past + n] bool: True where a node may attend, parents [n]) of a random draft tree of
    ``n`` nodes over ``past`` committed tokens: every node's parent drawn among the earlier ones, as
    the drafter's breadth-first flattening orders them."""
    from verifier.tree import tree_inputs

    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    _, mask = tree_inputs(parents, past)
    return (torch.ones((1, past + 1), dtype=torch.bool) if mask is None else mask), parents


# -- many families -----------------------------------------------------------------------------------

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
    "phi3": ("phi3", {}, "llama"),
    "gemma": ("gemma", {}, "llama"),
    "gemma2": ("gemma2", dict(sliding_window=8), "llama"),
    "stablelm": ("stablelm", {}, "hf"),
    "mpt": ("mpt", {}, "chain"),
    "gpt_bigcode": ("gpt_bigcode", {}, "hf"),
    "codegen": ("codegen", {}, "hf", dict(embed_scale=4.0)),
    "starcoder2": ("starcoder2", dict(sliding_window=8), "hf"),
    "olmo2": ("olmo2", {}, "hf", dict(seed=1, embed_scale=4.0)),
    # local and global layers alternating (Gemma 3's own pattern is five local layers to one global)
    "gemma3_text": ("gemma3_text", dict(sliding_window=8, sliding_window_pattern=2), "llama"),
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


def echo_prompt(m, n: int = 20) -> list[int]:
    """A prompt that holds a stretch of its own greedy continuation: retrieval drafts find it."""
    from .reference import hf_greedy

    base = [3, 7, 11]
    return base + hf_greedy(m, base, n)
