"""The drafter's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from common.metrics import LATENCY_MS_BUCKETS

DRAFT_MS = Histogram("racer_draft_latency_ms", "Drafter work per step message", buckets=LATENCY_MS_BUCKETS)
DRAFTER_SESSIONS = Gauge("racer_drafter_sessions", "Sessions held in drafter memory")
SNAPSHOT_BYTES = Histogram(
    "racer_snapshot_bytes", "Drafter snapshot size", buckets=(1e3, 1e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 1e7)
)
SNAPSHOT_MS = Histogram("racer_snapshot_latency_ms", "Snapshot save or restore", ["op"], buckets=LATENCY_MS_BUCKETS)
SNAPSHOT_FAILURES = Counter("racer_snapshot_failures", "Snapshot saves or restores that failed", ["op"])
RESTORES = Counter("racer_drafter_restores", "How a drafter session was found at open", ["source"])
DRAFTER_BYTES = Gauge("racer_drafter_session_bytes", "Estimated bytes of the sessions held in drafter memory")
EVICTIONS = Counter(
    "racer_drafter_evictions", "Idle sessions dropped from memory to stay within --max-memory-bytes (snapshot kept)"
)
