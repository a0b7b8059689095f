"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from common.metrics import LATENCY_MS_BUCKETS

NUM_DRAFTS = Counter("racer_spec_decode_num_drafts", "Draft trees verified", ["mode"])
NUM_DRAFT_TOKENS = Counter("racer_spec_decode_num_draft_tokens", "Draft tree nodes beyond the root", ["mode"])
NUM_ACCEPTED_TOKENS = Counter("racer_spec_decode_num_accepted_tokens", "Draft tokens accepted", ["mode"])
ACCEPTED_PER_POS = Counter(
    "racer_spec_decode_num_accepted_tokens_per_pos", "Rounds whose accepted path reached this depth", ["position"]
)
GENERATED_TOKENS = Counter("racer_generation_tokens", "Tokens streamed to clients")
REQUESTS = Counter("racer_requests", "Generate calls by outcome", ["code"])
ROUND_MS = Histogram("racer_round_latency_ms", "Draft + verify round seen by the gateway", buckets=LATENCY_MS_BUCKETS)
TTFT_MS = Histogram("racer_time_to_first_token_ms", "Request start to first streamed token", buckets=LATENCY_MS_BUCKETS)
ACTIVE_STREAMS = Gauge("racer_active_streams", "Generate streams in flight")
FAILOVERS = Counter("racer_failovers", "Drafter or verifier streams lost mid-turn and reopened elsewhere", ["kind"])
CORRUPT_RECORDS = Counter(
    "racer_session_records_corrupt", "Session records read from the store that failed validation (each read counts)"
)
STORE_FAILURES = Counter("racer_store_failures", "Session-store calls that failed (each retry counts)", ["op"])
QUOTA_REFUSALS = Counter(
    "racer_quota_refusals", "Turns refused because a tenant quota was full", ["quota"]
)  # no tenant label: tenants are unbounded
LEASE_LOST = Counter("racer_session_leases_lost", "Running turns that lost their session's lease (closed or expired)")
