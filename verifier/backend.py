"""What a backend is: the forward over one session's KV cache, and its bookkeeping.

Two backends implement it: ``verifier/llama.py`` (the hand-written Llama-family forward over a
preallocated cache) and ``verifier/hf.py`` (any causal LM's own forward over a ``DynamicCache``).
``verifier/engine.py`` chooses one per session (``make_backend``) and speaks to it through this
interface only. Rows: one row is one token's keys and values in every layer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

# mask: [n, length + n] bool, True = may attend.


@runtime_checkable
class Backend(Protocol):
    """One session's forward over its own KV cache."""

    dtype: torch.dtype
    device: torch.device
    length: int  # rows of the cache that hold committed context
    invariant: bool  # a row's bits do not depend on what else shares the forward (reduced precision)
    chain_only: bool  # verifies chains only (a tree is reduced to its first path)
    # Rows may be copied in from the prefix cache (``read_rows`` / ``write_rows``) and are then the
    # rows the session's own prefill would write (bit for bit in reduced precision; float32's
    # contract is token identity with transformers); False: every prompt is prefilled.
    prefix_exact: bool
    # The rows KV memory reserves for this cache (a growing cache grows to them at once); None: no
    # reservation to answer to.
    reserved_rows: int | None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """tokens, positions [n]; mask [n, length + n] or None (attend everything) -> hidden [n, hidden].
        Writes the new rows after ``length`` without committing them."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, V]."""
        ...

    def commit(self, keep: list[int] | None, n_new: int) -> None:
        """Keeps the new rows at offsets ``keep`` (ascending; None = all ``n_new``), drops the rest."""
        ...

    def truncate(self, length: int) -> None:
        """Drops the committed rows past ``length``."""
        ...

    def pad_rows(self) -> int:
        """Rows a forward writes past its tokens' own."""
        ...

    def resize(self, rows: int) -> None:
        """Allocates exactly ``max(rows, length)`` rows (a cache that holds only its committed rows
        has nothing to do)."""
        ...


def kept_rows(keep: list[int] | None, n_new: int) -> tuple[int, bool]:
    """``commit``'s arithmetic, shared by the backends: (new rows kept, whether they must be
    gathered because they are not the first ones of the new rows)."""
    if keep is None:
        return n_new, False
    return len(keep), keep != list(range(len(keep)))
