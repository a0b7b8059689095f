"""Random draft trees for attention tests and benchmarks: every node's parent drawn among the
earlier ones, as the drafter's breadth-first flattening orders them."""

from __future__ import annotations

import random

import torch

from verifier.tree import tree_inputs


def random_tree(rng: random.Random, past: int, n: int) -> tuple[torch.Tensor, list[int]]:
    """(mask [n, past + n] bool: True where a node may attend, parents [n]) of a random tree of ``n``
    nodes over ``past`` committed tokens."""
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    _, mask = tree_inputs(parents, past)
    return (torch.ones((1, past + 1), dtype=torch.bool) if mask is None else mask), parents
