"""What a request asks of the pipeline: the drafting mode, sampling and generation parameters.

Plain values with their checks, shared by the gateway (which validates requests with them), the
drafter, the verifier and the in-process engine. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import FieldError

MODES = ("racer", "retrieval", "logits", "last-logit", "pld", "off")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise FieldError("temperature", f"temperature={self.temperature}: must be a finite number >= 0")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise FieldError("top_k", f"top_k={self.top_k}: must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    mode: str = "racer"
    budget: int = 64  # tree nodes per round, root included; 0: adaptive (drafter.adaptive)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise FieldError("max_new_tokens", f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.budget < 0:
            raise FieldError("budget", f"budget={self.budget}: must be >= 1, or 0 for the cost-aware adaptive budget")
