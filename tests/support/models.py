"""Models for the tests: a tiny randomly initialised Llama, and one intra-op thread.

Tests run with one intra-op thread: a forward of the tiny Llama takes ~1 ms, and with two OpenMP
threads on a busy two-core machine the threads' spin-waits make every op 5-20x slower (the default
model too: 48 tokens of SmolLM2-135M took 6 s with one thread vs 30 s with two while the other core
was busy). One thread costs at most ~1.6x on an idle machine.
"""

from __future__ import annotations

import contextlib

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
