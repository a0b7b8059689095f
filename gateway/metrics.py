"""The gateway's Prometheus metrics.

Counters are exported with ``_total`` (prometheus_client appends it). Acceptance, in PromQL:
``rate(racer_spec_decode_num_accepted_tokens_total[5m]) / rate(racer_spec_decode_num_draft_tokens_total[5m])``;
mean acceptance length: ``1 + rate(..._accepted_tokens_total[5m]) / rate(racer_spec_decode_num_drafts_total[5m])``.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import Counter, Gauge, Histogram

from common.errors import Abort
from common.metrics import MODEL_SECONDS_BUCKETS, REQUEST_SECONDS_BUCKETS

NUM_DRAFTS = Counter("racer_spec_decode_num_drafts", "Draft trees verified", ["mode"])
NUM_DRAFT_TOKENS = Counter("racer_spec_decode_num_draft_tokens", "Draft tree nodes beyond the root", ["mode"])
NUM_ACCEPTED_TOKENS = Counter("racer_spec_decode_num_accepted_tokens", "Draft tokens accepted", ["mode"])
ACCEPTED_PER_POS = Counter(
    "racer_spec_decode_num_accepted_tokens_per_pos", "Rounds whose accepted path reached this depth", ["position"]
)
GENERATED_TOKENS = Counter("racer_generation_tokens", "Tokens streamed to clients", ["tenant"])
REQUESTS = Counter("racer_requests", "Generate calls by outcome", ["code"])
ROUND_SECONDS = Histogram(
    "racer_round_latency_seconds", "Draft + verify round seen by the gateway", buckets=MODEL_SECONDS_BUCKETS
)
ROUND_OVERHEAD_SECONDS = Gauge(
    "racer_round_overhead_seconds",
    "A round's time beyond the verifier's (drafted: the drafter and two RPCs; plain: one RPC), averaged: "
    "what the adaptive budget adds to a tree's forward and to a round without the drafter",
    ["round"],
)
TTFT_SECONDS = Histogram(
    "racer_time_to_first_token_seconds", "Request start to first streamed token", buckets=REQUEST_SECONDS_BUCKETS
)
# vLLM's name for it; a round's tokens leave together, so each gets the round's time / their number.
TPOT_SECONDS = Histogram(
    "racer_time_per_output_token_seconds",
    "Time between streamed chunks after the first, per token of the chunk (inter-token latency)",
    buckets=MODEL_SECONDS_BUCKETS,
)
ENDPOINTS = Gauge(
    "racer_gateway_healthy_endpoints", "Drafters or verifiers the gateway can route to (not marked down)", ["kind"]
)
ACTIVE_STREAMS = Gauge("racer_active_streams", "Generate streams in flight")
FAILOVERS = Counter("racer_failovers", "Drafter or verifier streams lost mid-turn and reopened elsewhere", ["kind"])
SESSIONS_MOVED = Counter(
    "racer_sessions_moved",
    "Sessions that continued on another drafter or verifier, by why they left: drain (it shut down), "
    "lost (its stream broke), full, unreachable (at open), gone (no longer among the endpoints)",
    ["kind", "reason"],
)
VERIFIER_WARMS = Counter(
    "racer_verifier_warms",
    "Verifiers that joined, asked to warm their prefix cache from the verifier holding the most blocks, by "
    "outcome: warmed (blocks taken), refused (none: off, or a check or the holder failed), failed (no answer)",
    ["outcome"],
)
PLACEMENTS = Counter(
    "racer_verifier_placements",
    "New sessions (and moved ones) placed on a verifier, by what decided: prefix (it holds a prefix of the "
    "prompt in its prefix cache), load (none it could take does)",
    ["by"],
)
REPREFILLED_TOKENS = Counter(
    "racer_reprefilled_tokens", "History tokens prefilled again on the verifier a session moved to"
)
CORRUPT_RECORDS = Counter(
    "racer_session_records_corrupt", "Session records read from the store that failed validation (each read counts)"
)
STORE_FAILURES = Counter("racer_store_failures", "Session-store calls that failed (each retry counts)", ["op"])
QUOTA_REFUSALS = Counter(
    "racer_quota_refusals", "Turns refused because a tenant quota was full", ["quota"]
)  # no tenant label: tenants are unbounded
QUEUE_WAITERS = Gauge(
    "racer_queue_waiters", "Turns waiting for a slot of their tenant on this gateway", ["tenant"]
)  # a tenant's label is removed when its queue empties
QUEUE_WAIT_SECONDS = Histogram(
    "racer_queue_wait_seconds", "Time a turn waited for a slot of its tenant", buckets=REQUEST_SECONDS_BUCKETS
)
QUEUE_REFUSALS = Counter(
    "racer_queue_refusals",
    "Turns refused after or instead of waiting: the queue was full or the wait too long",
    ["reason"],
)
LEASE_LOST = Counter("racer_session_leases_lost", "Running turns that lost their session's lease (closed or expired)")


@contextlib.contextmanager
def generate_call():
    """One Generate call, gRPC or HTTP: counted in ``ACTIVE_STREAMS`` while it runs, then in
    ``REQUESTS`` by outcome. Yields a one-item list holding the outcome ("OK"); an exception sets it
    (an ``Abort``: its code; cancelled or reset: CANCELLED; anything else, a bug: INTERNAL), and a
    handler that answers an error without raising sets it itself."""
    outcome = ["OK"]
    ACTIVE_STREAMS.inc()
    try:
        yield outcome
    except Abort as e:
        outcome[0] = e.code.name
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        outcome[0] = "CANCELLED"
        raise
    except Exception:
        outcome[0] = "INTERNAL"
        raise
    finally:
        ACTIVE_STREAMS.dec()
        REQUESTS.labels(outcome[0]).inc()
