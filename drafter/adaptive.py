"""Cost-aware draft budget: per round, the tree size that maximises expected tokens per second.

The verifier measures its cost curve, ``cost(n)``: milliseconds of one forward over ``n`` tree
nodes (it depends on the device, the model and, on a CPU, very much on the kernel MKL picks for
``n``). The drafter learns, per session, how many draft tokens a tree of budget C would have had
accepted, for *every* candidate C at once: it always builds the largest tree, and the tree of
budget C is the prefix of the C first-inserted nodes (``DraftTree.prefix``), so once the tokens
after a round are known, walking them down the big tree tells the accepted length of each prefix
(the accepted path is the longest tree path that matches the emitted tokens, greedy or sampled).
What was actually sent does not matter: "no speculation" keeps learning what speculation would do.

Each round then sends the prefix of size ``argmax_C (1 + E[accepted | C]) / (cost(C) + overhead)``.
"""

from __future__ import annotations

import math
from collections import deque

from .tree import DraftTree


class BudgetChooser:
    """Acceptance statistics of one session and the choice they imply."""

    def __init__(self, cost_ms: dict[int, float], overhead_ms: float = 1.0, window: int = 32, prior_rounds: float = 2.0):
        if not cost_ms or any(n < 1 or not (c > 0 and math.isfinite(c)) for n, c in cost_ms.items()):
            raise ValueError("cost_ms: need positive finite costs for sizes >= 1")
        self.sizes = sorted(cost_ms)
        self.cost = dict(cost_ms)
        self.overhead_ms = overhead_ms
        self.window = window
        self.prior_rounds = prior_rounds
        self.history: deque[list[int]] = deque(maxlen=window)  # per evaluated round: accepted per size
        # Trees still waiting for the tokens that decide them: (position of the root, tree, children index).
        self.pending: deque[tuple[int, DraftTree, dict, set]] = deque(maxlen=8)
        self.last_choice = self.sizes[0]

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def expected_accepted(self) -> list[float]:
        """E[accepted draft tokens | C] per candidate size, with a weak prior (log-shaped)."""
        n = len(self.history)
        out = []
        for j, c in enumerate(self.sizes):
            prior = 0.5 * math.log2(c)
            total = sum(h[j] for h in self.history) + self.prior_rounds * prior
            out.append(total / (n + self.prior_rounds))
        return out

    def choose(self) -> int:
        acc = self.expected_accepted()
        rates = [(1 + a) / (self.cost[c] + self.overhead_ms) for a, c in zip(acc, self.sizes)]
        best = max(range(len(rates)), key=rates.__getitem__)
        self.last_choice = self.sizes[best]
        return self.last_choice

    def drafted(self, root_pos: int, tree: DraftTree) -> None:
        """``tree`` (the full-size one) was drafted from the token that will sit at ``root_pos``."""
        index = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p >= 0}
        inner = {p for p in tree.parents if p >= 0}
        self.pending.append((root_pos, tree, index, inner))

    def observe(self, history: list[int]) -> None:
        """Evaluates the pending trees whose continuation ``history`` now decides."""
        while self.pending:
            pos, tree, index, inner = self.pending[0]
            node, ranks, j = 0, [], pos + 1
            while node in inner and j < len(history):
                nxt = index.get((node, history[j]))
                if nxt is None:
                    break
                ranks.append(tree.ranks[nxt])
                node, j = nxt, j + 1
            else:
                if node in inner:
                    return  # the tokens that decide this tree are not all known yet
            self.pending.popleft()
            self.history.append([sum(1 for r in ranks if r < c) for c in self.sizes])
