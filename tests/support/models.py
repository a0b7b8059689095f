"""Models for the tests: a tiny randomly initialised Llama, and one intra-op thread (written once, in
``racer/bench/tiny.py``, which says why one thread)."""

from __future__ import annotations

from racer.bench.tiny import make_tiny_llama, single_thread

__all__ = ["make_tiny_llama", "single_thread"]
