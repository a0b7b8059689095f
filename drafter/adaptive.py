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
The curve holds for the context it was measured over; a tree's rows each attend over the whole
session, so with the verifier's slope (``common.costs.ContextSlope``) ``cost(C)`` is priced at the
session's own length: a long session's trees cost more beside a one-token step than a short one's.

A round needs no drafter at all when no tree pays: ``plain_overhead`` (what a round costs beyond
the forward when the gateway goes to the verifier alone, without the drafter's hop) prices that
option, ``1 / (cost(1) + plain_overhead)``. When it wins, the choice is to *rest*: the gateway
verifies the next ``rest`` rounds without asking (one run of the verifier's), 1, 2, 4, ... up to 32
rounds for as long as the choice stands, and the step after them carries their tokens. Some of
those positions are drafted then, as they would have been (``DraftSession.catch_up``), so the
statistics keep following the text and the choice can come back to trees.

Under batching the verifier runs other sessions' trees in the same forward: what a tree of C nodes
costs is then its marginal cost, ``cost(R + C) - cost(R)`` with R the other sessions' rows (the
verifier reports R of the last batch). Where the forward is compute-bound, every row costs about
the same and a node that is not accepted is pure waste, so the choice falls to small trees or to
no speculation at all, which is what keeps a loaded verifier's throughput up.
"""

from __future__ import annotations

import math
from collections import deque

from common.costs import ContextSlope

from .tree import DraftTree

# Rounds without the drafter between two drafted rounds, at most. The gateway asks a rest's rounds of
# the verifier as one run, so a rest's rounds take no request each; each return to the drafter costs
# a drafted round and a new request. 32 against 8: 1.056x against 1.033x `off` without runs on 12
# Spec-Bench prompts (one stack, alternated per request). The rest's probes (``catch_up``) keep the
# statistics following the text meanwhile.
MAX_REST = 32


class BudgetChooser:
    """Acceptance statistics of one session and the choice they imply."""

    def __init__(
        self,
        cost_ms: dict[int, float],
        overhead_ms: float = 1.0,
        window: int = 32,
        prior_rounds: float = 2.0,
        plain_overhead_ms: float | None = None,
        slope: ContextSlope | None = None,
    ):
        if not cost_ms or any(n < 1 or not (c > 0 and math.isfinite(c)) for n, c in cost_ms.items()):
            raise ValueError("cost_ms: need positive finite costs for sizes >= 1")
        if plain_overhead_ms is not None and not (0 <= plain_overhead_ms < math.inf):
            raise ValueError(f"plain_overhead_ms: {plain_overhead_ms}, expected a finite value >= 0")
        self.sizes = sorted(cost_ms)
        self.cost = dict(cost_ms)
        self.slope = slope  # what the session's context adds to the curve (None: the curve as it is)
        # A non-decreasing envelope of the curve, for marginal costs (kernel choice makes it jagged).
        self._env_y = []
        for n in self.sizes:
            self._env_y.append(max(cost_ms[n], self._env_y[-1] if self._env_y else 0.0))
        self.overhead_ms = overhead_ms
        self.window = window
        self.prior_rounds = prior_rounds
        self.history: deque[list[int]] = deque(maxlen=window)  # per evaluated round: accepted per size
        # Trees still waiting for the tokens that decide them: (position of the root, tree, children index).
        self.pending: deque[tuple[int, DraftTree, dict, set]] = deque(maxlen=8)
        self.last_choice = self.sizes[0]
        # A round without the drafter, beyond its forward (None: every round is drafted), and what
        # the last choice left: rounds to verify without a tree (0: draft the next one).
        self.plain_overhead_ms = plain_overhead_ms
        self.rest = 0
        self._rests = 0  # choices to rest in a row

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

    def forward_ms(self, rows: float) -> float:
        """The envelope at ``rows`` (linear between sizes, extended with the last slope)."""
        xs, ys = self.sizes, self._env_y
        if rows <= xs[0]:
            return ys[0] * rows / xs[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if rows <= x1:
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1] / xs[-1]
        return ys[-1] + slope * (rows - xs[-1])

    def choose(self, other_rows: int = 0, length: int | None = None) -> int:
        """The best size now; ``other_rows``: rows of other sessions sharing the verifier's forward;
        ``length``: tokens in the session's context (with a slope, the costs are priced there)."""
        acc = self.expected_accepted()
        base = floor = 0.0
        if other_rows > 0:
            base = self.forward_ms(other_rows)
            floor = 0.01 * self._env_y[0]
            costs = [max(floor, self.forward_ms(other_rows + c) - base) for c in self.sizes]
        else:
            costs = [self.cost[c] for c in self.sizes]
        one = max(floor, self.forward_ms(other_rows + 1) - base) if other_rows > 0 else self.forward_ms(1)
        if self.slope is not None and length is not None:
            # each size's own rows over this context
            costs = [self.slope.priced(c, n, length) for n, c in zip(self.sizes, costs)]
            one = self.slope.priced(one, 1, length)
        rates = [(1 + a) / (c + self.overhead_ms) for a, c in zip(acc, costs)]
        best = max(range(len(rates)), key=rates.__getitem__)
        self.last_choice = self.sizes[best]
        self.rest = 0
        if self.plain_overhead_ms is not None:
            if 1 / (one + self.plain_overhead_ms) >= rates[best]:
                self._rests += 1
                self.rest = min(MAX_REST, 2 ** (self._rests - 1))
                self.last_choice = 1
                return 1
        self._rests = 0
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
