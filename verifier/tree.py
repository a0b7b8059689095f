"""Draft tree -> model inputs. Pure functions: no model, no cache."""

from __future__ import annotations

import torch


class InvalidTree(ValueError):
    """A tree whose parents are not a forest rooted at node 0 in topological order."""


def validate(tokens, parents, vocab_size: int, max_nodes: int | None = None) -> None:
    n = len(tokens)
    if n == 0:
        raise InvalidTree("tree.tokens: empty tree")
    if len(parents) != n:
        raise InvalidTree(f"tree.parents: {len(parents)} entries for {n} tokens")
    if max_nodes is not None and n > max_nodes:
        raise InvalidTree(f"tree.tokens: {n} nodes exceed the limit of {max_nodes}")
    if parents[0] != -1:
        raise InvalidTree("tree.parents[0]: the root's parent must be -1")
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise InvalidTree(f"tree.parents[{i}]={p}: must be in [0, {i}) (topological order, no cycles)")
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise InvalidTree(f"tree.tokens[{i}]={t}: outside the vocabulary [0, {vocab_size})")


def depths(parents) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def tree_inputs(parents, past_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """positions [n] = past_len + depth; mask [n, past_len + n] bool (True = may attend).

    Node i attends to the whole cached context, itself and its ancestors. A chain (every parent is
    the previous node) needs only the causal mask; a single node needs none (mask None).
    """
    n = len(parents)
    d = depths(parents)
    positions = torch.tensor(d, dtype=torch.long) + past_len
    if n == 1:
        return positions, None
    anc = torch.zeros((n, n), dtype=torch.bool)
    anc[0, 0] = True
    for i in range(1, n):
        anc[i] = anc[parents[i]]
        anc[i, i] = True
    mask = torch.ones((n, past_len + n), dtype=torch.bool)
    mask[:, past_len:] = anc
    return positions, mask


def child_index(tokens, parents) -> dict[tuple[int, int], int]:
    """(parent index, token) -> child index. Duplicate siblings: the first one wins."""
    out: dict[tuple[int, int], int] = {}
    for i in range(1, len(tokens)):
        out.setdefault((parents[i], tokens[i]), i)
    return out
