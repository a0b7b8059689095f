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
PREFILL_BATCH_SIZE = Histogram(
    "racer_prefill_batch_size", "Prompts prefilled together in one forward", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
)
# Exported as racer_verifier_run_rounds_total.
RUN_ROUNDS = Counter(
    "racer_verifier_run_rounds", "Rounds verified as part of a run (VerifyTree.run), beyond its first: no request each"
)
VERIFIER_SESSIONS = Gauge("racer_verifier_sessions", "KV caches held")
CACHE_TOKENS = Gauge("racer_verifier_cache_tokens", "Tokens held in all KV caches")
# Exported with _total (racer_verifier_evictions_total, racer_verifier_reused_tokens_total).
EVICTIONS = Counter("racer_verifier_evictions", "KV caches dropped", ["reason"])
REUSED_TOKENS = Counter("racer_verifier_reused_tokens", "History tokens found in the KV cache at open")
# KV memory; exported under its first name, which dashboards and alerts query.
KV_MEMORY_BYTES = Gauge("racer_verifier_kv_budget_bytes", "KV memory the caches may hold, in bytes")
KV_RESERVED_BYTES = Gauge("racer_verifier_kv_reserved_bytes", "KV memory reserved by the caches, in bytes")
ADMISSIONS = Counter(
    "racer_verifier_admissions",
    "KV reservations by outcome: now, queued (after a wait), never_fits, queue_full, timed_out",
    ["outcome"],
)
ADMISSION_WAITING = Gauge("racer_verifier_admission_waiting", "Requests waiting for KV memory")
MODEL_QUEUE = Gauge("racer_verifier_model_queue", "Jobs (prefill chunks, tree batches) waiting for the model thread")
ROUND_WAIT_TOKENS = Histogram(
    "racer_verifier_round_wait_tokens",
    "Prompt tokens prefilled ahead of a round (a batch of trees) while it waited: at most --prefill-lead "
    "plus one prefill chunk",
    buckets=(0, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
MODEL_STALLED = Gauge("racer_verifier_model_stalled", "1 while the model thread has work but finished none lately")
SATURATION = Gauge(
    "racer_verifier_saturation",
    "max(KV reserved / budget / 0.8, (model queue + admission queue) / 5): 1 = saturated (verifier/load.py)",
)
# The prefix cache (verifier/prefix_cache.py); exported with _total where they count.
PREFIX_BYTES = Gauge("racer_verifier_prefix_cache_bytes", "KV memory the prefix cache's blocks hold, in bytes")
PREFIX_LOOKUPS = Counter(
    "racer_verifier_prefix_cache_lookups",
    "Opens that looked up the prefix cache, by outcome: hit (rows copied from it), miss",
    ["outcome"],
)
PREFIX_SAVED_TOKENS = Counter(
    "racer_verifier_prefix_cache_saved_tokens", "Prompt tokens whose rows were copied from the prefix cache"
)
PREFIX_EVICTED_BLOCKS = Counter("racer_verifier_prefix_cache_evicted_blocks", "Prefix cache blocks evicted for room")
# Prefix blocks moved between verifiers (verifier/prefix_fetch.py); exported with _total where they count.
PREFIX_FETCH_DECISIONS = Counter(
    "racer_verifier_prefix_fetch_decisions",
    "Opens told where their prompt's blocks are, by choice: fetch (cheaper by the measured rule), prefill",
    ["choice"],
)
PREFIX_FETCHED_BLOCKS = Counter("racer_verifier_prefix_fetched_blocks", "Prefix blocks fetched from other verifiers")
PREFIX_FETCHED_BYTES = Counter("racer_verifier_prefix_fetched_bytes", "Bytes of prefix blocks fetched")
PREFIX_FETCH_REFUSED = Counter(
    "racer_verifier_prefix_fetch_refused",
    "Transfers from another verifier discarded (the open prefilled), by reason: scope, fingerprint, hash, "
    "deadline, budget, source (the holder failed, stopped answering, or ended early)",
    ["reason"],
)
PREFIX_SERVED_BLOCKS = Counter("racer_verifier_prefix_served_blocks", "Prefix blocks sent to other verifiers")
PREFIX_SERVED_BYTES = Counter("racer_verifier_prefix_served_bytes", "Bytes of prefix blocks sent to other verifiers")
PREFIX_SERVE_REFUSED = Counter(
    "racer_verifier_prefix_serve_refused",
    "Requests of other verifiers for prefix blocks refused, by reason: fingerprint, budget",
    ["reason"],
)
# The same transfers, by use: a moving session's rows off a draining verifier, a joining verifier's warm-up.
PREFIX_HANDOVER_ROWS = Counter(
    "racer_verifier_prefix_handover_rows",
    "KV rows of sessions moving off a draining verifier, by side: sent (the draining one), received (the new one)",
    ["side"],
)
PREFIX_HANDOVER_BYTES = Counter(
    "racer_verifier_prefix_handover_bytes", "Bytes of KV rows of sessions moving off a draining verifier", ["side"]
)
PREFIX_WARMED_ROWS = Counter(
    "racer_verifier_prefix_warmed_rows", "KV rows a joining verifier took into its prefix cache from a holder"
)
PREFIX_WARMED_BYTES = Counter("racer_verifier_prefix_warmed_bytes", "Bytes of KV rows a joining verifier warmed with")
PREFIX_TRANSFER_REFUSED = Counter(
    "racer_verifier_prefix_transfer_refused",
    "Hand-overs and warm-ups not used (the open prefilled; the cache stayed cold), by use (handover, warm) "
    "and reason (those of racer_verifier_prefix_fetch_refused_total)",
    ["use", "reason"],
)
PREFIX_HANDOVER_WAIT_SECONDS = Gauge(
    "racer_verifier_prefix_handover_wait_seconds",
    "How long the last drain kept serving hand-overs after its streams had ended",
)
PREFIX_FETCH_SECONDS = Histogram(
    "racer_verifier_prefix_fetch_seconds", "A transfer of prefix blocks, used or not", buckets=REQUEST_SECONDS_BUCKETS
)
PREFIX_PREFILL_PER_TOKEN = Gauge(
    "racer_verifier_prefill_seconds_per_token", "Prefill seconds per token, as the fetch rule averages them"
)
PREFIX_FETCH_RATE = Gauge(
    "racer_verifier_prefix_fetch_bytes_per_second", "Transfer rate of prefix blocks, as the fetch rule averages it"
)
# The native kernels' start-up check (verifier/native_check.py): 1 for a kernel it refused (its calls
# take another path), 0 for one that agreed with its reference.
KERNEL_REFUSED = Gauge("racer_verifier_kernel_refused", "Native kernels refused by the start-up check", ["kernel"])
KERNEL_CHECK_SECONDS = Gauge("racer_verifier_kernel_check_seconds", "Seconds the native kernels' start-up check took")
