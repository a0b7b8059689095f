"""Every service setting in one place: its flag, its environment variable and its default.

Deployment files (docker-compose.yml, k8s/) name these variables and ports; tests compare them with
this table, so the files cannot drift from what the services read.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    flag: str
    env: str
    default: object
    help: str
    type: type = str


# Ports each service listens on by default: gRPC (health and reflection on the same port) and the
# Prometheus metrics HTTP port.
PORTS = {
    "gateway": (50051, 9100),
    "drafter": (50061, 9101),
    "verifier": (50062, 9102),
}

# gRPC service names each server registers with grpc.health.v1 (besides the overall "" entry).
HEALTH_SERVICES = {
    "gateway": "racer.v1.Generation",
    "drafter": "racer.v1.Drafter",
    "verifier": "racer.v1.Verifier",
}

COMMON = [
    Setting("--host", "RACER_HOST", "0.0.0.0", "address to bind"),
    Setting("--log-level", "RACER_LOG_LEVEL", "INFO", "logging level"),
    Setting("--drain-seconds", "RACER_DRAIN_SECONDS", 20.0, "on SIGTERM, time in-flight streams get to finish", float),
    Setting(
        "--max-message-bytes",
        "RACER_MAX_MESSAGE_BYTES",
        16 * 1024 * 1024,
        "largest gRPC message accepted or sent (a larger one gets RESOURCE_EXHAUSTED)",
        int,
    ),
    Setting(
        "--keepalive-seconds",
        "RACER_KEEPALIVE_SECONDS",
        10.0,
        "gRPC keepalive: ping a peer that has been silent this long, drop it when the ping is not answered "
        "in as long again (a frozen peer's streams are freed)",
        float,
    ),
    Setting(
        "--cpus",
        "RACER_CPUS",
        "",
        "CPUs this service runs on, as a Linux CPU list (e.g. 1 or 0,2-3); empty: any (common/cpus.py)",
    ),
    Setting(
        "--tls-cert",
        "RACER_TLS_CERT",
        "",
        "PEM certificate chain of this server; with --tls-key the gRPC port serves TLS only",
    ),
    Setting("--tls-key", "RACER_TLS_KEY", "", "PEM private key of --tls-cert"),
    Setting(
        "--tls-client-ca",
        "RACER_TLS_CLIENT_CA",
        "",
        "PEM CA bundle: clients must present a certificate it signed (mutual TLS); needs --tls-cert",
    ),
    Setting(
        "--health-port",
        "RACER_HEALTH_PORT",
        0,
        "also serve grpc.health.v1 alone, in plaintext, on this port (probes while the gRPC port needs mutual "
        "TLS; 0: off)",
        int,
    ),
    Setting(
        "--internal-token",
        "RACER_INTERNAL_TOKEN",
        "",
        "shared secret of the gateways and their drafters and verifiers (prefer the env or the file: a flag shows "
        "in ps); comma-separated: all accepted, the gateway sends the first (rotation)",
    ),
    Setting(
        "--internal-token-file",
        "RACER_INTERNAL_TOKEN_FILE",
        "",
        "file holding the internal token(s), e.g. a mounted Secret; adds to --internal-token",
    ),
    Setting(
        "--otlp-endpoint",
        "RACER_OTLP_ENDPOINT",
        "",
        "OpenTelemetry collector for traces, e.g. http://collector:4317 (OTLP/gRPC); empty: "
        "OTEL_EXPORTER_OTLP_ENDPOINT if set, else tracing off (common/tracing.py)",
    ),
]

# Drafters and verifiers refuse to start without a way to authenticate their callers (an internal
# token or mutual TLS) unless this is set: common/identity.py.
ALLOW_UNAUTHENTICATED = Setting(
    "--allow-unauthenticated",
    "RACER_ALLOW_UNAUTHENTICATED",
    0,
    "1: serve without an internal token or mutual TLS, so anyone who reaches the port can read and drop "
    "every tenant's sessions (a trusted single-host setup only)",
    int,
)

SERVICE = {
    "drafter": [
        Setting(
            "--snapshot-url", "RACER_SNAPSHOT_URL", "memory://", "snapshot store: memory:// or redis://host:port/db"
        ),
        Setting(
            "--snapshot-every", "RACER_SNAPSHOT_EVERY", 32, "rounds between snapshots (also at every turn end)", int
        ),
        Setting(
            "--session-ttl", "RACER_SESSION_TTL", 1800.0, "seconds an idle session (and its snapshot) is kept", float
        ),
        Setting("--max-nodes", "RACER_MAX_NODES", 10_000, "automaton capacity per session", int),
        Setting("--window", "RACER_WINDOW", 10, "longest n-gram in the automaton", int),
        Setting("--topk", "RACER_TOPK", 8, "copy-logit row width", int),
        Setting(
            "--prior",
            "RACER_PRIOR",
            "default",
            "copy-logit prior: 'default' (shipped for the default model), a .npy path, or 'none'",
        ),
        Setting(
            "--max-session-tokens", "RACER_MAX_SESSION_TOKENS", 65_536, "longest session history a drafter takes", int
        ),
        ALLOW_UNAUTHENTICATED,
        Setting(
            "--max-memory-bytes",
            "RACER_MAX_MEMORY_BYTES",
            1 << 30,
            "estimated bytes of the sessions a drafter keeps in memory; past it the least recently used idle ones "
            "leave memory and restore from their snapshot at their next turn (0: bounded only by the TTL)",
            int,
        ),
        Setting(
            "--corpus-tokens",
            "RACER_CORPUS_TOKENS",
            1 << 20,
            "default bound of a tenant corpus in tokens (the tenant limits file may set another per tenant; "
            "0: no tenant corpora on this drafter)",
            int,
        ),
        Setting(
            "--corpus-idle",
            "RACER_CORPUS_IDLE",
            600.0,
            "seconds without a session of a tenant before this drafter drops its corpus from memory",
            float,
        ),
    ],
    "verifier": [
        Setting(
            "--model",
            "RACER_MODEL",
            "default",
            "target model: 'default' or a Hugging Face causal-LM directory (tokenizer files not needed)",
        ),
        Setting("--backend", "RACER_BACKEND", "auto", "forward implementation: auto, fast or hf"),
        Setting("--device", "RACER_DEVICE", "auto", "torch device: auto, cpu or cuda"),
        Setting(
            "--dtype",
            "RACER_DTYPE",
            "float32",
            "model and KV cache dtype: float32 (output equals Hugging Face greedy), bfloat16 or float16 (output "
            "equals the engine's own decoding without drafts; Llama-family models only), or auto (bfloat16 on "
            "CUDA or a CPU with AMX/AVX512-BF16, else float32)",
        ),
        Setting("--threads", "RACER_THREADS", 0, "torch CPU threads (0: torch's default, one per core)", int),
        Setting(
            "--max-batch", "RACER_MAX_BATCH", 16, "trees of concurrent sessions verified in one forward, at most", int
        ),
        Setting(
            "--max-wait-ms",
            "RACER_MAX_WAIT_MS",
            20.0,
            "longest a batch waits for the other streaming sessions' trees (it waits a quarter of a forward at most)",
            float,
        ),
        Setting(
            "--measure-cost",
            "RACER_MEASURE_COST",
            1,
            "measure the cost curve at start-up for the adaptive budget (0: off)",
            int,
        ),
        Setting("--topk", "RACER_TOPK", 8, "top-k ids returned per position", int),
        Setting("--session-ttl", "RACER_SESSION_TTL", 1800.0, "seconds an idle KV cache is kept", float),
        Setting("--max-sessions", "RACER_MAX_SESSIONS", 64, "KV caches kept; the least recently used goes first", int),
        Setting("--max-cache-tokens", "RACER_MAX_CACHE_TOKENS", 262_144, "tokens held in all KV caches together", int),
        ALLOW_UNAUTHENTICATED,
        Setting(
            "--kv-budget-bytes",
            "RACER_KV_BUDGET_BYTES",
            0,
            "bytes all KV caches may hold together (0: 60 percent of the cgroup memory limit left after the model's "
            "weights, or --max-cache-tokens tokens' worth without a limit)",
            int,
        ),
        Setting(
            "--kv-headroom-tokens",
            "RACER_KV_HEADROOM_TOKENS",
            320,
            "cache rows an open reserves past the history and the turn's new tokens (a draft tree; the new "
            "tokens too when the open names none); a cache grows past them by another reservation",
            int,
        ),
        Setting(
            "--admission-queue",
            "RACER_ADMISSION_QUEUE",
            64,
            "requests that may wait for KV memory at once; one more gets RESOURCE_EXHAUSTED",
            int,
        ),
        Setting(
            "--admission-wait-seconds",
            "RACER_ADMISSION_WAIT_SECONDS",
            20.0,
            "longest a request waits for KV memory (less when the client's deadline is sooner)",
            float,
        ),
        Setting(
            "--prefill-chunk",
            "RACER_PREFILL_CHUNK",
            512,
            "tokens of a prompt prefilled per model-thread job: other tenants' work runs between chunks "
            "(also each tenant's fair share per turn)",
            int,
        ),
        Setting(
            "--prefill-batch",
            "RACER_PREFILL_BATCH",
            16,
            "prompts of waiting sessions prefilled together in one forward (of at most --prefill-chunk tokens "
            "in all); 1: one prompt per forward",
            int,
        ),
        Setting(
            "--prefill-lead",
            "RACER_PREFILL_LEAD",
            2048,
            "prompt tokens prefilled ahead of a waiting round of running streams: a burst gets its first "
            "tokens sooner, and a running stream waits behind at most this much prefill (plus one chunk); "
            "0: rounds always go first",
            int,
        ),
        Setting(
            "--stall-seconds",
            "RACER_STALL_SECONDS",
            60.0,
            "health turns NOT_SERVING (and new sessions are refused) when work has waited this long with no "
            "forward finished",
            float,
        ),
    ],
    "gateway": [
        Setting(
            "--model",
            "RACER_MODEL",
            "default",
            "tokenizer source: 'default', a Hugging Face model directory, or 'none' (no tokenizer: clients send "
            "prompt_ids, end-of-turn tokens come only from stop_ids, and the verifier checks the vocabulary)",
        ),
        Setting(
            "--drafters", "RACER_DRAFTERS", "localhost:50061", "drafter endpoints: host:port,... or dns:///name:port"
        ),
        Setting(
            "--verifiers", "RACER_VERIFIERS", "localhost:50062", "verifier endpoints: host:port,... or dns:///name:port"
        ),
        Setting("--session-url", "RACER_SESSION_URL", "memory://", "session store: memory:// or redis://host:port/db"),
        Setting("--session-ttl", "RACER_SESSION_TTL", 1800.0, "seconds an idle session record is kept", float),
        Setting(
            "--api-keys",
            "RACER_API_KEYS",
            "",
            "file of 'key tenant' lines (a file without keys refuses every call); unset: no auth, local use only",
        ),
        Setting(
            "--api-keys-reload-seconds",
            "RACER_API_KEYS_RELOAD_SECONDS",
            10.0,
            "seconds between checks of the API key file for changes (read again when changed, and on SIGHUP; 0: "
            "SIGHUP only)",
            float,
        ),
        Setting(
            "--resolve-every", "RACER_RESOLVE_EVERY", 10.0, "seconds between DNS re-resolutions of endpoints", float
        ),
        Setting(
            "--max-prompt-tokens",
            "RACER_MAX_PROMPT_TOKENS",
            8192,
            "longest session history (all turns, this turn's input included) a turn may start from",
            int,
        ),
        Setting("--max-new-tokens", "RACER_MAX_NEW_TOKENS", 2048, "largest max_new_tokens accepted", int),
        Setting("--max-budget", "RACER_MAX_BUDGET", 256, "largest draft budget accepted", int),
        Setting(
            "--max-sessions-per-tenant",
            "RACER_MAX_SESSIONS_PER_TENANT",
            32,
            "sessions of one tenant generating at once on one gateway, and the default of the tenant's turns "
            "quota across all gateways (--tenant-limits); more wait in the tenant's queue (0: no limit). Without "
            "--api-keys (one local tenant) neither applies unless --tenant-limits sets turns: KV memory and the "
            "verifiers' batch are the limits",
            int,
        ),
        Setting(
            "--queue-max-waiters",
            "RACER_QUEUE_MAX_WAITERS",
            256,
            "turns of one tenant that may wait on one gateway for a slot of its turns limit; more get "
            "RESOURCE_EXHAUSTED with a retry hint at once (0: no queue)",
            int,
        ),
        Setting(
            "--queue-wait-seconds",
            "RACER_QUEUE_WAIT_SECONDS",
            120.0,
            "longest wait of a turn for a slot of its tenant (sooner if the client's deadline is sooner); then "
            "RESOURCE_EXHAUSTED with a retry hint",
            float,
        ),
        Setting(
            "--queue-poll-seconds",
            "RACER_QUEUE_POLL_SECONDS",
            1.0,
            "a waiting turn at the head of its tenant's queue tries for a slot this often even without a "
            "notice that one freed (notices come through the session store's pub/sub): the longest delay "
            "between a freed slot and its next turn",
            float,
        ),
        Setting(
            "--tenant-limits",
            "RACER_TENANT_LIMITS",
            "",
            "TOML (or .json) file of per-tenant quotas: a [default] table and [tenants.<name>] overrides of "
            "sessions, tokens and turns (gateway/quotas.py); unset: the defaults below for every tenant",
        ),
        Setting(
            "--max-sessions-kept",
            "RACER_MAX_SESSIONS_KEPT",
            64,
            "default quota: sessions one tenant keeps in the session store, counted across gateways (0: no limit)",
            int,
        ),
        Setting(
            "--max-tokens-stored",
            "RACER_MAX_TOKENS_STORED",
            524_288,
            "default quota: tokens of all one tenant's sessions (a turn reserves its history + max_new_tokens), "
            "counted across gateways (0: no limit)",
            int,
        ),
        Setting(
            "--lease-seconds",
            "RACER_LEASE_SECONDS",
            10.0,
            "a turn's lease on its session in the store, renewed every third of it while the turn runs; a "
            "gateway that dies mid-turn blocks the session this long",
            float,
        ),
        Setting(
            "--backend-timeout",
            "RACER_BACKEND_TIMEOUT",
            60.0,
            "seconds a drafter or verifier may take to answer one message before the gateway fails over",
            float,
        ),
        Setting(
            "--reconnect-seconds",
            "RACER_RECONNECT_SECONDS",
            15.0,
            "when every drafter (or verifier) has failed, how long a turn waits for one to come back",
            float,
        ),
        Setting(
            "--store-retry-seconds",
            "RACER_STORE_RETRY_SECONDS",
            10.0,
            "how long session-store calls are retried before the call fails with UNAVAILABLE",
            float,
        ),
        Setting(
            "--tls-ca",
            "RACER_TLS_CA",
            "",
            "PEM CA bundle that signed the drafters' and verifiers' certificates; set: the gateway talks TLS to them",
        ),
        Setting(
            "--tls-client-cert",
            "RACER_TLS_CLIENT_CERT",
            "",
            "PEM certificate the gateway presents to drafters and verifiers (for their --tls-client-ca)",
        ),
        Setting("--tls-client-key", "RACER_TLS_CLIENT_KEY", "", "PEM private key of --tls-client-cert"),
        Setting(
            "--http-port",
            "RACER_HTTP_PORT",
            0,
            "OpenAI-compatible HTTP API port (/v1/chat/completions, /v1/completions, /v1/models; 0: off)",
            int,
        ),
        Setting(
            "--served-model-name",
            "RACER_SERVED_MODEL_NAME",
            "",
            "the model name the HTTP API lists and accepts (default: the --model directory's name)",
        ),
        Setting(
            "--tls-server-name",
            "RACER_TLS_SERVER_NAME",
            "",
            "name the drafters' and verifiers' certificates must carry (default: the endpoint's host; set it when "
            "endpoints are pod IPs)",
        ),
    ],
}


def env_names(service: str) -> set[str]:
    return {s.env for s in COMMON + SERVICE[service]}


def add_arguments(parser: argparse.ArgumentParser, service: str) -> None:
    """Flags for ``service``; each defaults to its environment variable, then to the table."""
    port, metrics = PORTS[service]
    settings = (
        COMMON
        + SERVICE[service]
        + [
            Setting("--port", "RACER_PORT", port, "gRPC port", int),
            Setting("--metrics-port", "RACER_METRICS_PORT", metrics, "Prometheus metrics HTTP port (0: off)", int),
        ]
    )
    for s in settings:
        raw = os.environ.get(s.env)
        default = s.type(raw) if raw is not None else s.default
        parser.add_argument(s.flag, type=s.type, default=default, help=f"{s.help} (env {s.env}; default {s.default})")
