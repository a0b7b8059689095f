"""The drafter's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from common.metrics import FAST_SECONDS_BUCKETS

DRAFT_SECONDS = Histogram("racer_draft_latency_seconds", "Drafter work per step message", buckets=FAST_SECONDS_BUCKETS)
DRAFTER_SESSIONS = Gauge("racer_drafter_sessions", "Sessions held in drafter memory")
SNAPSHOT_BYTES = Histogram(
    "racer_snapshot_bytes", "Drafter snapshot size", buckets=(1e3, 1e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 1e7)
)
SNAPSHOT_SECONDS = Histogram(
    "racer_snapshot_latency_seconds", "Snapshot save (encode + write) or restore", ["op"], buckets=FAST_SECONDS_BUCKETS
)
# Exported with _total (racer_snapshot_failures_total, racer_drafter_restores_total).
SNAPSHOT_FAILURES = Counter("racer_snapshot_failures", "Snapshot saves or restores that failed", ["op"])
RESTORES = Counter("racer_drafter_restores", "How a drafter session was found at open", ["source"])
DRAFTER_BYTES = Gauge("racer_drafter_session_bytes", "Estimated bytes of the sessions held in drafter memory")
EVICTIONS = Counter(
    "racer_drafter_evictions", "Idle sessions dropped from memory to stay within --max-memory-bytes (snapshot kept)"
)
# The tenant corpus (drafter/corpora.py).
CORPUS_TOKENS = Gauge("racer_corpus_tokens", "Tokens held in a tenant's corpus on this drafter", ["tenant"])
CORPUS_BYTES = Gauge(
    "racer_corpus_bytes", "Bytes of the tenant corpora held by this drafter (counted in --max-memory-bytes)"
)
CORPUS_TENANTS = Gauge("racer_corpus_tenants", "Tenant corpora held by this drafter")
CORPUS_INDEX_SECONDS = Histogram(
    "racer_corpus_index_latency_seconds", "Indexing what one sync read of a tenant stream", buckets=FAST_SECONDS_BUCKETS
)
CORPUS_LOAD_SECONDS = Histogram(
    "racer_corpus_load_seconds",
    "Loading a tenant corpus from the store (read + index)",
    buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30),
)
CORPUS_LAG_SECONDS = Histogram(
    "racer_corpus_replication_lag_seconds",
    "From a chunk's write to the store to its indexing on this replica",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
)
# Exported with _total (racer_corpus_record_failures_total).
CORPUS_RECORD_FAILURES = Counter(
    "racer_corpus_record_failures", "Corpus records that could not be written or were unusable when read"
)
# Exported with _total: racer_draft_nodes_total{source}, racer_draft_accepted_total{source}.
DRAFT_NODES = Counter("racer_draft_nodes", "Draft tree nodes (root excluded) by source", ["source"])
DRAFT_ACCEPTED = Counter("racer_draft_accepted", "Accepted draft tree nodes by source", ["source"])
PREFIX_OPENS = Counter(
    "racer_drafter_prefix_opens",
    "New sessions by their shared prompt prefix: shared (an existing one), built (made now), none",
    ["result"],
)
PREFIXES = Gauge("racer_drafter_shared_prefixes", "Shared prompt prefixes held by this drafter")
PREFIX_BYTES = Gauge("racer_drafter_shared_prefix_bytes", "Estimated bytes of the shared prompt prefixes held")
