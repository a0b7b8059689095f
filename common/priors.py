"""Copy-logit priors: per token, the target model's own top-k next tokens in a neutral context.

The verifier computes them from the weights (``verifier/prior.py``); the drafter reads them. The
prior of the bundled default model ships in ``common/data/``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).resolve().parent / "data"


def load_prior(spec: str, topk: int) -> np.ndarray | None:
    """'none', a .npy path, or 'default': the prior shipped for the bundled default model."""
    if spec in ("", "none"):
        return None
    if spec == "default":
        shipped = sorted(p for p in SHIPPED.iterdir() if p.name.endswith(f"-k{topk}.npy"))
        if not shipped:
            log.warning("no shipped copy-logit prior for topk=%d; drafting without one", topk)
            return None
        spec = str(shipped[0])
    table = np.load(spec, allow_pickle=False)
    if table.ndim != 2 or table.shape[1] < topk:
        raise ValueError(f"prior {spec}: shape {table.shape}, need [vocab, >= {topk}]")
    return table
