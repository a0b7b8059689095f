"""Copy-logit table: for each token id, the target's top-k next tokens at its most recent position."""

from __future__ import annotations


class CopyLogitTable:
    """Sparse: a session only pays for the token ids it has seen (a dict of tuples)."""

    __slots__ = ("k", "rows")

    def __init__(self, k: int = 8):
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k
        self.rows: dict[int, tuple[int, ...]] = {}

    def put(self, token: int, topk) -> None:
        self.rows[token] = tuple(topk[: self.k])

    def put_many(self, tokens, topk_rows) -> None:
        """Later positions win: call in context order."""
        rows, k = self.rows, self.k
        for t, row in zip(tokens, topk_rows):
            rows[t] = tuple(row[:k])

    def get(self, token: int) -> tuple[int, ...]:
        return self.rows.get(token, ())

    def __len__(self) -> int:
        return len(self.rows)
