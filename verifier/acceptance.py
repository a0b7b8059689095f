"""Which part of a draft tree the target accepts.

Walk from the root; at each node ask the target for its token (``choose``): the argmax for greedy
decoding, one sample from the processed distribution when sampling. If a child carries that token,
descend; otherwise that token is the bonus and the round ends. Drafts are deterministic guesses, so
with sampling every emitted token is still exactly one draw from the target's distribution given
its prefix: lossless by construction, and with a seeded generator the very same draws as plain
sampling.
"""

from __future__ import annotations

from typing import Callable

from .tree import child_index


def accept(tokens, parents, choose: Callable[[int], int]) -> tuple[list[int], int]:
    """Returns (accepted node indices, root first; bonus token)."""
    children = child_index(tokens, parents)
    path = [0]
    node = 0
    while True:
        t = choose(node)
        nxt = children.get((node, t))
        if nxt is None:
            return path, t
        path.append(nxt)
        node = nxt
