"""Tiny random-weight causal LMs of many ``transformers`` families, built in the test (no downloads):
``racer/bench/tiny.py`` builds them (``make``); here each is built once per test process."""

from __future__ import annotations

import functools

from racer.bench.tiny import FAMILIES, VOCAB, backend_kind, echo_prompt, make

__all__ = ["FAMILIES", "VOCAB", "backend_kind", "echo_prompt", "make", "model"]


@functools.lru_cache(maxsize=None)
def model(name: str):
    """``make(name)``, built once per test process (the tests only read it)."""
    return make(name)
