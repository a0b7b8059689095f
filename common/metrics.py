"""What the services' Prometheus metrics share: histogram buckets. Each service declares its own
metrics in its package (``drafter/metrics.py``, ``verifier/metrics.py``, ``gateway/metrics.py``), so a
process registers only the metrics of the service it runs.

Names follow Prometheus conventions (base units: latencies are ``_seconds`` histograms; counters are
exported with ``_total``, which prometheus_client appends to a Counter's name) and the
speculative-decoding names users know from vLLM: drafts, draft tokens, accepted tokens, per-position
acceptance; mean acceptance length = 1 + accepted / drafts. ``deploy/grafana/racer.json`` and
``k8s/components/monitoring`` query them; ``tests/deploy/test_monitoring.py`` checks that every name
they use is one of these.
"""

from __future__ import annotations

# Bucket bounds in seconds, fitted to what the services measure (README, "Measured"): a drafter
# step takes 0.1-0.6 ms and a snapshot save or restore 1-20 ms; a verification 2-10 ms on a GPU and
# 30-200 ms on two CPU cores, a round the same plus 1-2 ms; a prefill or a first token 10 ms to a
# few seconds (long histories on CPU).
FAST_SECONDS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)
"""Drafter work and store calls."""
MODEL_SECONDS_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
"""A forward of the target model: a verification, a round, the time per output token."""
REQUEST_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
"""A prefill, a first token."""
