"""Random draft trees for attention tests (written once, in ``racer/bench/tiny.py``)."""

from __future__ import annotations

from racer.bench.tiny import random_tree

__all__ = ["random_tree"]
