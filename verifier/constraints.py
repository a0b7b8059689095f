"""What a turn asks of the target's choice beyond sampling: the tokens a grammar allows at each
position, and the log-probabilities of what was chosen.

A mask belongs to one position: after the prompt (``VerifierOpen.mask``) or after one tree node's
own path (``VerifyTree.masks``, one row per node). The gateway, which holds the grammar, computes
each row from that node's path; here the row only removes tokens before the target chooses, so a
draft the grammar forbids is never accepted and every emitted token is the one the target picks
among the allowed ones, drafts or not.

Log-probabilities are of the target's own distribution (``log_softmax`` of its float32 logits,
before any mask or sampling setting). A row's logits are computed the same way whatever shares the
forward in reduced precision (batch-invariant kernels), so there they are bit-identical with and
without drafts; in float32 a larger forward may pick another kernel, so they agree within float32
rounding of the logits (about 1e-6 absolute on a log-probability).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def words(vocab: int) -> int:
    """int32 words of one mask row."""
    return (vocab + 31) // 32


def unpack(data: bytes, rows: int, vocab: int) -> torch.Tensor | None:
    """Packed masks (``rows`` rows of ``words(vocab)`` little-endian int32) as bool [rows, vocab];
    None for no masks. ValueError if the size does not fit."""
    if not data:
        return None
    w = words(vocab)
    if len(data) != rows * w * 4:
        raise ValueError(f"masks: {len(data)} bytes, expected {rows} rows of {w} int32 words ({rows * w * 4} bytes)")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8).reshape(rows, w * 4), axis=1, bitorder="little")
    allowed = bits[:, :vocab].astype(bool)
    # A row that allows nothing is left as it is: the grammar has no continuation there, which the
    # gateway ends before asking (the row of a node past the grammar's end, or off it: never chosen).
    allowed[~allowed.any(axis=1)] = True
    return torch.from_numpy(allowed)


def masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [..., V] with the tokens not ``allowed`` at -inf (numpy reduced the rows: torch's
    reductions over a bool tensor cost milliseconds here)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, float("-inf"))


@dataclass
class LogProbs:
    """Of the chosen tokens, in order: their log-probabilities, and the top ``n`` (ids, values)."""

    chosen: list[float]
    top_ids: list[list[int]]
    top: list[list[float]]


def logprobs(logits: torch.Tensor, chosen: list[int], n: int) -> LogProbs:
    """``logits`` [len(chosen), V] (raw), the token chosen at each row, and ``n`` top entries per row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(chosen, dtype=torch.long)
    values = lp.gather(1, idx[:, None])[:, 0].tolist()
    if n <= 0:
        return LogProbs(values, [[] for _ in chosen], [[] for _ in chosen])
    top = torch.topk(lp, min(n, lp.shape[-1]), dim=-1)
    return LogProbs(values, top.indices.tolist(), top.values.tolist())


@dataclass
class Adjust:
    """OpenAI's ``logit_bias`` and presence and frequency penalties, added to raw logits before the
    choice. Penalties count the tokens generated in the turn before a position: in a tree, those of
    that node's own path, so a node's row is what one-token decoding of that path computes."""

    bias: torch.Tensor | None  # [V] float32, or None
    presence: float = 0.0
    frequency: float = 0.0

    @staticmethod
    def of(bias: dict[int, float], presence: float, frequency: float, vocab: int) -> Adjust | None:
        if not bias and not presence and not frequency:
            return None
        b = None
        if bias:
            b = torch.zeros(vocab)
            ids = torch.tensor(list(bias), dtype=torch.long)
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
            b[ids] = torch.tensor(list(bias.values()), dtype=torch.float32)
        return Adjust(b, presence, frequency)

    def apply(self, logits: torch.Tensor, contexts: list[list[int]]) -> torch.Tensor:
        """``logits`` [n, V]; ``contexts[i]``: the tokens generated before row i's choice."""
        x = logits.float().clone()
        if self.bias is not None:
            x += self.bias
        if self.presence or self.frequency:
            for i, ctx in enumerate(contexts):
                if ctx:
                    ids, counts = torch.tensor(ctx, dtype=torch.long).unique(return_counts=True)
                    x[i, ids] -= self.presence + self.frequency * counts.float()
        return x
