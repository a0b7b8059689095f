"""The one percentile definition every benchmark and load report uses."""

from __future__ import annotations

import math


def percentile(xs: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it (NaN when
    there are none). The p99 of 100 values is the 99th smallest."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
