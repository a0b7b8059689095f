"""The verifier's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from common.metrics import MODEL_SECONDS_BUCKETS, REQUEST_SECONDS_BUCKETS

VERIFY_SECONDS = Histogram(
    "racer_verify_latency_seconds", "Verifier forward + acceptance per tree", buckets=MODEL_SECONDS_BUCKETS
)
PREFILL_SECONDS = Histogram(
    "racer_prefill_latency_seconds", "Verifier prefill per open", buckets=REQUEST_SECONDS_BUCKETS
)
BATCH_SIZE = Histogram(
    "racer_verify_batch_size", "Trees verified together in one forward", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
)
VERIFIER_SESSIONS = Gauge("racer_verifier_sessions", "KV caches held")
CACHE_TOKENS = Gauge("racer_verifier_cache_tokens", "Tokens held in all KV caches")
CACHE_TOKENS_LIMIT = Gauge("racer_verifier_cache_tokens_limit", "Tokens all KV caches may hold (--max-cache-tokens)")
# Exported with _total (racer_verifier_evictions_total, racer_verifier_reused_tokens_total).
EVICTIONS = Counter("racer_verifier_evictions", "KV caches dropped", ["reason"])
REUSED_TOKENS = Counter("racer_verifier_reused_tokens", "History tokens found in the KV cache at open")
