"""The processed target distribution (temperature, top-k, top-p) and a seeded sampler."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.params import SamplingParams

if TYPE_CHECKING:
    import torch


def processed_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] -> probabilities [V] after temperature, top-k and top-p (nucleus) filtering."""
    import torch

    x = logits.float()
    # Shift first: the top logit becomes 0, so a tiny temperature gives -inf tails, never inf - inf.
    x = (x - x.max()) / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cum - torch.softmax(sorted_x, -1)) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return torch.softmax(x, -1)


class Sampler:
    """Draws from the processed distribution with its own seeded generator."""

    def __init__(self, params: SamplingParams):
        import torch

        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        import torch

        probs = processed_probs(logits, self.params)
        return int(torch.multinomial(probs, 1, generator=self.generator))
