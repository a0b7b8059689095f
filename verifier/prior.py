"""A model-derived copy-logit prior: each token's top-k successors in a neutral context.

A fresh session's copy-logit table only knows tokens it has seen, so the first time a token is the
root of a draft its logits tree is empty. The prior fills that gap with the target model's own top-k
after the token, computed once per model (it depends on the weights only, never on any session's or
tenant's text) and cached next to the converted model.

All tokens are computed as one "star" batch per chunk: every query row attends to the shared
neutral prefix and itself, at the same position, in a single forward.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from common.priors import SHIPPED

from .engine import make_backend
from .llama import LlamaBackend
from .paths import cache_root

log = logging.getLogger(__name__)


def neutral_prefix(tokenizer) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


@torch.inference_mode()
def compute_prior(model, prefix: list[int], topk: int = 8, chunk: int = 512, progress=None) -> np.ndarray:
    """[vocab, topk]: top-k next-token ids after ``prefix + [t]`` for every token t (uint16 when ids fit)."""
    backend = make_backend(model)
    vocab = model.config.vocab_size
    p = len(prefix)
    if p:
        backend.forward(torch.tensor(prefix), torch.arange(p), torch.ones((p, p), dtype=torch.bool).tril())
        backend.commit(None, p)
    out = np.zeros((vocab, topk), dtype=np.uint16 if vocab <= 1 << 16 else np.uint32)
    for start in range(0, vocab, chunk):
        ids = torch.arange(start, min(vocab, start + chunk))
        n = len(ids)
        mask = torch.zeros((n, p + n), dtype=torch.bool)
        mask[:, :p] = True
        mask[:, p:] = torch.eye(n, dtype=torch.bool)
        hidden = backend.forward(ids, torch.full((n,), p), mask)
        out[start : start + n] = torch.topk(backend.logits(hidden), topk, dim=-1).indices.numpy()
        backend.truncate(p)
        if progress:
            progress(n)
    return out


def fingerprint(model) -> str:
    """Identifies the weights cheaply: config plus a few sampled values of every tensor."""
    h = hashlib.sha256(model.config.to_json_string().encode())
    for name, t in model.state_dict().items():
        flat = t.reshape(-1)
        h.update(name.encode())
        h.update(flat[:: max(1, flat.numel() // 64)][:64].float().numpy().tobytes())
    return h.hexdigest()[:16]


# Priors shipped with the package (the bundled default model's), then the user's cache.


def find_or_compute(model, tokenizer, topk: int, cache_dir: Path | None = None, compute: bool = True):
    """The prior for these weights: shipped, cached, or computed now and cached (None if unsupported)."""
    name = f"prior-{fingerprint(model)}-k{topk}.npy"
    path = (cache_dir or cache_root() / "priors") / name
    for candidate in (SHIPPED / name, path):
        if candidate.exists():
            return np.load(candidate)
    if not compute:
        return None
    if not LlamaBackend.supports(model):
        log.info("no copy-logit prior for model_type=%s (the hf backend would take too long)", model.config.model_type)
        return None
    log.warning(
        "computing the copy-logit prior for %d tokens (once per model; cached in %s)", model.config.vocab_size, path
    )
    from tqdm import tqdm

    with tqdm(total=model.config.vocab_size, desc="copy-logit prior", unit="tok", leave=False) as bar:
        table = compute_prior(model, neutral_prefix(tokenizer), topk, progress=bar.update)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, table)
    tmp.replace(path)
    return table
