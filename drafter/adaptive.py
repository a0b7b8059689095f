"""Cost-aware draft budget: per round, the tree size that maximises expected tokens per second.

The verifier measures its cost curve, ``cost(n)``: milliseconds of one forward over ``n`` tree
nodes (it depends on the device, the model and, on a CPU, very much on the kernel MKL picks for
``n``). The drafter learns, per session, how many draft tokens a tree of budget C would have had
accepted, for *every* candidate C at once: it builds the largest tree that could pay (``largest``:
every size on a flat curve, up to 16-32 nodes on a CPU where the curve climbs), and the tree of
budget C is the prefix of the C first-inserted nodes (``DraftTree.prefix``), so once the tokens
after a round are known, walking them down the big tree tells the accepted length of each prefix
(the accepted path is the longest tree path that matches the emitted tokens, greedy or sampled).
What was actually sent does not matter: "no speculation" keeps learning what speculation would do.

Each round then sends the prefix of size ``argmax_C (1 + E[accepted | C]) / (cost(C) + overhead)``.
The statistics are kept per kind of round (``round_kind``): a round whose tree holds a retrieval or
corpus continuation, and one whose tree is the copy-logit guess alone. The two differ by an order of
magnitude: on 12 Spec-Bench prompts with the default model, a 4-node tree got 1.29 tokens accepted
in the first kind and 0.20 in the second, which made up 77% of the rounds. The choice for a round
reads its own kind's statistics (the session's others as their prior).

The curve holds for the context it was measured over; a tree's rows each attend over the whole
session, so with the verifier's slope (``common.costs.ContextSlope``) ``cost(C)`` is priced at the
session's own length: a long session's trees cost more beside a one-token step than a short one's.

A round needs no drafter at all when no tree pays: ``plain_overhead`` (what a round costs beyond
the forward when the gateway goes to the verifier alone, without the drafter's hop) prices that
option, ``1 / (cost(1) + plain_overhead)``. When it wins for the round at hand, the next round may
still be one where a tree pays: what asking the drafter again is worth is what the kinds' trees save,
by how often each kind comes, less what a drafted round costs beyond a plain one where no tree pays.
While that is positive the drafter is asked every round (a one-node tree where none pays). Otherwise
the choice is to *rest*: the gateway verifies the next ``rest`` rounds without asking (one run of
the verifier's), 1, 2, 4, ... up to 32 rounds for as long as the choice stands, and the step after
them carries their tokens. Some of those positions are drafted then, as they would have been
(``DraftSession.catch_up``), so the statistics keep following the text and the choice can come back
to trees.

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

# Tokens beyond the most a window's round had accepted that the drafted tree leaves room for, so
# that a run of longer acceptances can show itself (``BudgetChooser.largest``).
HEADROOM = 2

RETRIEVED = 1  # a round whose tree holds a retrieval or corpus continuation
GUESSED = 0  # a round whose tree holds the copy-logit guess alone
KINDS = (GUESSED, RETRIEVED)


def round_kind(tree: DraftTree) -> int:
    """The kind of round a drafted tree makes, as the budget keeps its statistics."""
    return RETRIEVED if tree.n_retrieval or tree.corpus_nodes else GUESSED


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
        self.history: deque[list[float]] = deque(maxlen=window)  # per evaluated round: accepted per size
        self.by_kind = {k: deque(maxlen=window) for k in KINDS}  # the same, per kind of round
        self.kinds: deque[int] = deque(maxlen=window)  # the kinds of the last evaluated rounds
        # each window's sums by size, kept as rounds come and go (``record``)
        self._sums: dict[int | None, list[float]] = {k: [0.0] * len(self.sizes) for k in (None, *KINDS)}
        # Trees still waiting for the tokens that decide them: (position of the root, tree, children
        # index, inner nodes, kind).
        self.pending: deque[tuple[int, DraftTree, dict, set, int]] = deque(maxlen=8)
        self.last_choice = self.sizes[0]
        # A round without the drafter, beyond its forward (None: every round is drafted), and what
        # the last choice left: rounds to verify without a tree (0: draft the next one).
        self.plain_overhead_ms = plain_overhead_ms
        self.rest = 0
        self._rests = 0  # choices to rest in a row

    @property
    def largest(self) -> int:
        """The size drafted each round, whose prefixes are the smaller trees: the largest that would
        pay with ``HEADROOM`` tokens more accepted than the most any round of the window got (every
        size before a round is known, and on a flat curve). A bigger tree would be drafted for
        statistics only: a 64-node draft takes about three times a 16-node one."""
        if not self.history:
            return self.sizes[-1]
        most = max(h[-1] for h in self.history)
        one = self.cost[self.sizes[0]] + self.overhead_ms
        fits = [n for n in self.sizes if self.cost[n] + self.overhead_ms < (1 + most + HEADROOM) * one]
        return max(fits[-1] if fits else self.sizes[0], self.sizes[min(1, len(self.sizes) - 1)])

    def expected_accepted(self, kind: int | None = None) -> list[float]:
        """E[accepted draft tokens | C] per candidate size: over every round with a weak prior
        (log-shaped), or over rounds of ``kind`` with that as its prior."""
        n, w = len(self.history), self.prior_rounds
        pooled = [(t + w * 0.5 * math.log2(c)) / (n + w) for t, c in zip(self._sums[None], self.sizes)]
        return pooled if kind is None else self._of_kind(kind, pooled)

    def _of_kind(self, kind: int, pooled: list[float]) -> list[float]:
        """E[accepted | C] over the rounds of ``kind``, with ``pooled`` (every round's) as the prior."""
        own, w = self.by_kind[kind], max(self.prior_rounds, 1.0)
        if not own:
            return pooled
        return [(t + w * p) / (len(own) + w) for t, p in zip(self._sums[kind], pooled)]

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

    def choose(self, other_rows: int = 0, length: int | None = None, kind: int | None = None) -> int:
        """The best size now; ``other_rows``: rows of other sessions sharing the verifier's forward;
        ``length``: tokens in the session's context (with a slope, the costs are priced there);
        ``kind``: the round's (``round_kind`` of its tree; None: every round's statistics)."""
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
        pooled = self.expected_accepted()
        best, rate = self._best(pooled if kind is None else self._of_kind(kind, pooled), costs)
        self.last_choice = best
        self.rest = 0
        if self.plain_overhead_ms is not None:
            plain = one + self.plain_overhead_ms  # a token's ms in rounds without the drafter
            if 1 / plain >= rate:
                self.last_choice = 1
                if kind is not None and self._asking_pays(costs, plain, pooled):
                    return 1  # a one-node tree, and the drafter asked again next round
                self._rests += 1
                self.rest = min(MAX_REST, 2 ** (self._rests - 1))
                return 1
        self._rests = 0
        return self.last_choice

    def _best(self, acc: list[float], costs: list[float]) -> tuple[int, float]:
        """The size with the most tokens per ms, and that rate, for expected acceptances ``acc``."""
        rates = [(1 + a) / (c + self.overhead_ms) for a, c in zip(acc, costs)]
        best = max(range(len(rates)), key=rates.__getitem__)
        return self.sizes[best], rates[best]

    def _asking_pays(self, costs: list[float], plain: float, pooled: list[float]) -> bool:
        """Whether asking the drafter next round gains more than it costs (``plain``: a token's ms
        without it). A round of a kind saves, with that kind's best size, ``(1 + a) * plain - (cost
        + overhead)`` ms; with a one-node tree, where no tree pays, it loses the drafter's hop."""
        if not self.kinds:
            return False
        gain = 0.0
        for k in KINDS:
            share = self.kinds.count(k) / len(self.kinds)
            if share:
                acc = self._of_kind(k, pooled)
                gain += share * max((1 + a) * plain - c - self.overhead_ms for a, c in zip(acc, costs))
        return gain > 0

    def drafted(self, root_pos: int, tree: DraftTree) -> None:
        """``tree`` (the full-size one) was drafted from the token that will sit at ``root_pos``."""
        index = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p >= 0}
        inner = {p for p in tree.parents if p >= 0}
        self.pending.append((root_pos, tree, index, inner, round_kind(tree)))

    def observe(self, history: list[int]) -> None:
        """Evaluates the pending trees whose continuation ``history`` now decides."""
        while self.pending:
            pos, tree, index, inner, kind = self.pending[0]
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
            self.record([sum(1 for r in ranks if r < c) for c in self.sizes], kind)

    def record(self, accepted: list[float], kind: int) -> None:
        """One evaluated round of ``kind``: the draft tokens each candidate size had accepted."""
        if len(accepted) != len(self.sizes):
            raise ValueError(f"accepted: {len(accepted)} values for {len(self.sizes)} sizes")
        for window, key in ((self.history, None), (self.by_kind[kind], kind)):
            sums = self._sums[key]
            if len(window) == window.maxlen:
                for j, a in enumerate(window[0]):
                    sums[j] -= a
            window.append(accepted)
            for j, a in enumerate(accepted):
                sums[j] += a
        self.kinds.append(kind)
