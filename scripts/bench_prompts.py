"""Random prompts for the benchmarks, optionally beginning with the same tokens (a chat template's
system prompt). Plain Python: a benchmark that imports it still runs against an older tree."""

from __future__ import annotations

import random


def common_head_length(shared: int, lengths: list[int]) -> int:
    """The leading tokens prompts of these lengths can have in common: ``shared``, clamped to the
    shortest prompt."""
    return max(0, min(shared, *lengths))


def prompts_with_common_head(rng: random.Random, vocab: int, lengths: list[int], shared: int) -> list[list[int]]:
    """One prompt of each length, all beginning with the same ``common_head_length`` tokens (a
    prompt is never longer than its length)."""
    head = [rng.randrange(vocab) for _ in range(common_head_length(shared, lengths))]
    return [head + [rng.randrange(vocab) for _ in range(n - len(head))] for n in lengths]
