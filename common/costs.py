"""What the context adds to a verifier's cost curve.

The curve (ms of one verification by tree size) is measured over one context length; a tree's
attention reads every key of its session's cache for each of its rows, so on a CPU a 4-node tree
over 1,000 tokens costs far more beside a one-token step than it does over 256 (the default model's
GGUF blocks, AMD EPYC Zen 3: 1.8x one step against 1.4x). The verifier measures the curve at a
second length too, and ``ContextSlope`` carries the difference per token: the adaptive budget
prices each round at its session's own length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ContextSlope:
    context: int  # tokens of cache the curve's ms hold for
    per_token: dict[int, float]  # tree size -> ms each token of context beyond ``context`` adds

    def __post_init__(self):
        if self.context < 0:
            raise ValueError(f"context: {self.context}, expected >= 0")
        if not self.per_token or any(n < 1 or not (0 <= v < math.inf) for n, v in self.per_token.items()):
            raise ValueError("per_token: need finite values >= 0 for sizes >= 1")

    def at(self, rows: float) -> float:
        """Ms per token of context for a forward of ``rows`` rows: linear between the measured sizes,
        in proportion to the rows beyond them."""
        memo = self.__dict__.setdefault("_at", {})  # the budget prices a dozen sizes every round
        known = memo.get(rows)
        if known is not None:
            return known
        sizes = sorted(self.per_token)
        if rows <= sizes[0] or rows >= sizes[-1]:
            edge = sizes[0] if rows <= sizes[0] else sizes[-1]
            value = self.per_token[edge] * rows / edge
        else:
            x1 = next(x for x in sizes if x >= rows)
            x0 = sizes[sizes.index(x1) - 1]
            y0, y1 = self.per_token[x0], self.per_token[x1]
            value = y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        if len(memo) < 4096:  # row counts: the sizes, and the sizes beside other sessions' rows
            memo[rows] = value
        return value

    def ms(self, rows: float, length: int) -> float:
        """What ``length`` tokens of context add to (or, below ``context``, take from) a forward of
        ``rows`` rows."""
        return self.at(rows) * (length - self.context)

    def priced(self, ms: float, rows: float, length: int) -> float:
        """``ms``, a forward of ``rows`` rows at the curve's context, priced at ``length`` tokens; never
        below a tenth of it (a short session's slope takes time off, never all of it)."""
        return max(0.1 * ms, ms + self.ms(rows, length))


FOLLOW = 0.05  # a forward's weight in the curve's running average (``follow``)


def follow(curve: dict[int, float], slope: ContextSlope | None, rows: int, length: int, ms: float) -> None:
    """Moves ``curve[rows]`` toward a forward of ``rows`` rows that took ``ms`` over ``length`` tokens
    of context: an exponential average that follows the machine's drift (its load, its speed), with
    the context's part taken out where the slope is known (else the average follows the lengths
    too); never below a tenth of what it was. A size the curve does not hold is left alone."""
    if rows not in curve:
        return
    at_curve = ms - (slope.ms(rows, length) if slope is not None else 0.0)
    curve[rows] = max(0.1 * curve[rows], curve[rows] + FOLLOW * (at_curve - curve[rows]))


def slope_from(short: dict[int, float], long: dict[int, float], context: int, long_context: int) -> ContextSlope:
    """The slope between two curves measured at ``context`` and ``long_context`` tokens (each
    size's difference per token, none below 0: a size measured faster at the longer context only
    drifted)."""
    if long_context <= context:
        raise ValueError(f"long_context {long_context} must exceed context {context}")
    span = long_context - context
    return ContextSlope(context, {n: max(0.0, (long[n] - short[n]) / span) for n in short if n in long})
