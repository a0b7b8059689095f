"""Prometheus metrics of the three services (one registry per process).

Names follow the speculative-decoding conventions users know from vLLM: drafts, draft tokens,
accepted tokens, per-position acceptance; mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_MS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)

# gateway
NUM_DRAFTS = Counter("racer_spec_decode_num_drafts", "Draft trees verified", ["mode"])
NUM_DRAFT_TOKENS = Counter("racer_spec_decode_num_draft_tokens", "Draft tree nodes beyond the root", ["mode"])
NUM_ACCEPTED_TOKENS = Counter("racer_spec_decode_num_accepted_tokens", "Draft tokens accepted", ["mode"])
ACCEPTED_PER_POS = Counter(
    "racer_spec_decode_num_accepted_tokens_per_pos", "Rounds whose accepted path reached this depth", ["position"]
)
GENERATED_TOKENS = Counter("racer_generation_tokens", "Tokens streamed to clients")
REQUESTS = Counter("racer_requests", "Generate calls by outcome", ["code"])
ROUND_MS = Histogram("racer_round_latency_ms", "Draft + verify round seen by the gateway", buckets=_MS)
TTFT_MS = Histogram("racer_time_to_first_token_ms", "Request start to first streamed token", buckets=_MS)
ACTIVE_STREAMS = Gauge("racer_active_streams", "Generate streams in flight")
FAILOVERS = Counter("racer_failovers", "Drafter or verifier streams lost mid-turn and reopened elsewhere", ["kind"])
STORE_FAILURES = Counter("racer_store_failures", "Session-store calls that failed (each retry counts)", ["op"])

# drafter
DRAFT_MS = Histogram("racer_draft_latency_ms", "Drafter work per step message", buckets=_MS)
DRAFTER_SESSIONS = Gauge("racer_drafter_sessions", "Sessions held in drafter memory")
SNAPSHOT_BYTES = Histogram(
    "racer_snapshot_bytes", "Drafter snapshot size", buckets=(1e3, 1e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 1e7)
)
SNAPSHOT_MS = Histogram("racer_snapshot_latency_ms", "Snapshot save or restore", ["op"], buckets=_MS)
SNAPSHOT_FAILURES = Counter("racer_snapshot_failures", "Snapshot saves or restores that failed", ["op"])
RESTORES = Counter("racer_drafter_restores", "How a drafter session was found at open", ["source"])

# verifier
VERIFY_MS = Histogram("racer_verify_latency_ms", "Verifier forward + acceptance per tree", buckets=_MS)
PREFILL_MS = Histogram("racer_prefill_latency_ms", "Verifier prefill per open", buckets=_MS)
BATCH_SIZE = Histogram("racer_verify_batch_size", "Trees verified together in one forward", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
VERIFIER_SESSIONS = Gauge("racer_verifier_sessions", "KV caches held")
CACHE_TOKENS = Gauge("racer_verifier_cache_tokens", "Tokens held in all KV caches")
EVICTIONS = Counter("racer_verifier_evictions", "KV caches dropped", ["reason"])
REUSED_TOKENS = Counter("racer_verifier_reused_tokens", "History tokens found in the KV cache at open")
