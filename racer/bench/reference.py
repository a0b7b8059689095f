"""What outputs are checked against: Hugging Face's own greedy decoding, and the round loop over plain
sessions in this process (no services). The tests, the benchmarks and the scripts share them."""

from __future__ import annotations

import torch

from common.loop import Stats, generate
from common.params import GenerationParams
from drafter.draft_session import DraftSession
from verifier.engine import VerifierSession


@torch.inference_mode()
def hf_greedy(
    model, prompt: list[int], max_new_tokens: int, eos: tuple[int, ...] = (), lookup: int = 0, pad: int | None = None
) -> list[int]:
    """transformers' own greedy decoding: the reference every output must equal token for token.
    Whatever sampling the model's generation config names is switched off. ``lookup``: HF's prompt
    lookup decoding with that many tokens (the same output, drafted); ``pad``: the padding id (the
    model's, else 0)."""
    if pad is None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    kw = dict(prompt_lookup_num_tokens=lookup) if lookup else {}
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones((1, len(prompt)), dtype=torch.long, device=model.device),
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        repetition_penalty=None,
        eos_token_id=list(eos) if eos else None,
        pad_token_id=pad,
        **kw,
    )
    return out[0, len(prompt) :].tolist()


def run(drafter, verifier, prompt, params: GenerationParams) -> tuple[list[int], Stats, list[list[int]]]:
    """``generate`` to the end: (output, stats, the chunks as they were emitted)."""
    stats = Stats()
    chunks = list(generate(drafter, verifier, prompt, params, stats))
    return [t for c in chunks for t in c], stats, chunks


def run_racer(model, prompt, backend="llama", **params) -> tuple[list[int], Stats, list[list[int]]]:
    """A fresh draft session and verifier session of ``model``; ``params``: ``GenerationParams``'."""
    return run(DraftSession(), VerifierSession(model, backend=backend), prompt, GenerationParams(**params))
