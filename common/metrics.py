"""What the services' Prometheus metrics share: histogram buckets. Each service declares its own
metrics in its package (``drafter/metrics.py``, ``verifier/metrics.py``, ``gateway/metrics.py``), so a
process registers only the metrics of the service it runs.

Names follow the speculative-decoding conventions users know from vLLM: drafts, draft tokens,
accepted tokens, per-position acceptance; mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

LATENCY_MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
