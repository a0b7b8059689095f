"""Every service setting in one place: its flag, its environment variable, its type, its default
and its help. ``racer serve``, ``racer stack``, ``racer.launch.defaults`` and the tests read them
through this table only.

Deployment files (docker-compose.yml, k8s/) name these variables and ports; tests compare them with
this table, so the files cannot drift from what the services read.

Values are checked by pydantic's ``TypeAdapter`` for the setting's type (a boolean takes
1/0/true/false/yes/no/on/off and is a real ``bool``). A value that does not parse is a
``SettingError`` that names the flag or the variable and the type expected. Environment variables
are read when a command's settings are resolved (``resolve``, ``resolve_flags``), not when its
parser is built, so a malformed ``RACER_*`` variable stops only the commands that read it, with one
line.

A command with a flag of its own for a service's setting (``racer stack --dtype``, ``racer bench
--backend``: ``add_flag``) reads it as the service does: the flag, else the variable, else the
default (the table's, or the command's own where it has one).

A renamed setting keeps its old flag (``old_flags``), variable (``old_envs``) and values
(``old_values``): they keep working and warn (a ``DeprecationWarning`` and a log line).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

log = logging.getLogger("racer.settings")

TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean (1/0, true/false, yes/no)"}


class SettingError(ValueError):
    """A flag or variable whose value does not parse; the message names it and the type expected."""


def deprecated(message: str) -> None:
    """An old name or value was used: a ``DeprecationWarning`` and a log line, both saying what to use."""
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    log.warning(message)


@functools.cache
def _adapter(kind: type) -> TypeAdapter:
    return TypeAdapter(kind)


@dataclass(frozen=True)
class Setting:
    flag: str
    env: str
    default: object
    help: str
    type: type = str
    choices: tuple[str, ...] = ()
    old_flags: tuple[str, ...] = ()  # earlier names of the flag: accepted, with a deprecation warning
    old_envs: tuple[str, ...] = ()  # earlier names of the variable: read when the new one is unset, with a warning
    old_values: tuple[tuple[str, str], ...] = ()  # (earlier value, the value it now is): accepted, with a warning

    @property
    def dest(self) -> str:
        """The attribute that holds its value: ``--max-batch`` -> ``max_batch``."""
        return self.flag.removeprefix("--").replace("-", "_")

    def parse(self, raw: str, source: str) -> object:
        """``raw`` (from the flag or variable ``source``) as this setting's type."""
        renamed = dict(self.old_values).get(raw)
        if renamed is not None:
            deprecated(f"{source} {raw!r} is deprecated: use {renamed!r}")
            raw = renamed
        try:
            value = _adapter(self.type).validate_python(raw)
        except ValidationError:
            raise SettingError(f"{source}={raw!r}: expected {TYPE_NAMES[self.type]}") from None
        if self.choices and value not in self.choices:
            raise SettingError(f"{source}={raw!r}: expected one of {', '.join(self.choices)}")
        return value

    def from_env(self, environ: Mapping[str, str]) -> object:
        """Its value from ``environ`` (the variable, else a deprecated one), else the table's default."""
        if self.env in environ:
            return self.parse(environ[self.env], self.env)
        for old in self.old_envs:
            if old in environ:
                deprecated(f"{old} is deprecated: use {self.env}")
                return self.parse(environ[old], old)
        return self.default


# The verifier's forward implementations (verifier/): "llama" is the hand-written Llama-family
# forward, "hf" the model's own forward with tree masks; "auto" picks llama where it applies.
BACKENDS = ("auto", "llama", "hf")
# Their earlier names, (old, now): accepted with a warning by the flag, the variable and
# ``verifier.engine.make_backend`` alike.
OLD_BACKENDS = (("fast", "llama"), ("generic", "hf"))
# Model and KV cache dtypes; "auto": float32 for a model the "hf" backend verifies (it takes no other),
# else bfloat16 on CUDA, the default model's GGUF blocks on a CPU, else bfloat16 where the CPU computes
# it natively, else float32 (verifier.model.auto_dtype);
# "gguf" serves the default model's projections as its GGUF file stores them (float32 around them).
DTYPES = ("float32", "bfloat16", "float16", "gguf", "auto")

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
    Setting(
        "--host",
        "RACER_HOST",
        "0.0.0.0",
        "address to bind; unix:PATH: the gRPC server listens on that Unix domain socket instead of --port (the "
        "metrics and HTTP listeners then bind all interfaces)",
    ),
    Setting(
        "--ports-file",
        "RACER_PORTS_FILE",
        "",
        "once serving, write what this process listens on (grpc address, port, health, metrics, http) as JSON to "
        "this file: how a supervisor learns the ports of listeners set to -1, and that this process (not another "
        "one on the same port) is the one listening",
    ),
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
        "TLS; 0: off; -1: a port the OS picks)",
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
    False,
    "serve without an internal token or mutual TLS, so anyone who reaches the port can read and drop "
    "every tenant's sessions (a trusted single-host setup only)",
    bool,
)

SERVICE = {
    "drafter": [
        Setting(
            "--snapshot-url", "RACER_SNAPSHOT_URL", "memory://", "snapshot store: memory:// or redis://host:port/db"
        ),
        Setting(
            "--logits-tree",
            "RACER_LOGITS_TREE",
            "halving",
            "shape of the copy-logit tree: halving (the paper's) or best-first",
            str,
            choices=("halving", "best-first"),
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
            "estimated bytes of the sessions and tenant corpora a drafter keeps in memory; past it the least "
            "recently used idle sessions leave memory and restore from their snapshot at their next turn "
            "(0: bounded only by the TTL)",
            int,
        ),
        Setting(
            "--shared-prefix-tokens",
            "RACER_SHARED_PREFIX_TOKENS",
            512,
            "shortest prompt start (tokens, rounded up to 64-token blocks) that a tenant's new sessions share "
            "when two of them begin with it: built once, referenced by each session and its snapshot instead of "
            "copied (0: no sharing)",
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
        Setting(
            "--corpus-ttl",
            "RACER_CORPUS_TTL",
            7 * 86400.0,
            "seconds a tenant's corpus stream stays in the store after its last write",
            float,
        ),
    ],
    "verifier": [
        Setting(
            "--model",
            "RACER_MODEL",
            "default",
            "target model: 'default', a Hugging Face causal-LM directory (tokenizer files not needed), a GGUF file "
            "or a directory holding one (converted once to a cached float32 directory)",
        ),
        Setting(
            "--backend",
            "RACER_BACKEND",
            "auto",
            "forward implementation: llama (the hand-written Llama-family forward), hf (the model's own "
            "forward with tree masks) or auto (llama where it implements the model, else hf); 'fast' and "
            "'generic' are the old names of llama and hf",
            choices=BACKENDS,
            old_values=OLD_BACKENDS,
        ),
        Setting("--device", "RACER_DEVICE", "auto", "torch device: auto, cpu or cuda"),
        Setting(
            "--dtype",
            "RACER_DTYPE",
            "auto",
            "model and KV cache dtype: float32 (output equals Hugging Face greedy), bfloat16 or float16 (output "
            "equals the engine's own decoding without drafts; Llama-family models only), gguf (a GGUF file's "
            "blocks read in place, the default model's too, 8-bit activations; output equals the engine's own "
            "decoding without drafts), or auto (a model on the hf backend: float32, the only dtype it verifies; "
            "else CUDA: bfloat16; a CPU: gguf for a GGUF file whose formats the block kernel built here takes, "
            "else bfloat16 with AMX/AVX512-BF16, else float32)",
            choices=DTYPES,
        ),
        Setting("--threads", "RACER_THREADS", 0, "torch CPU threads (0: torch's default, one per core)", int),
        Setting(
            "--round-threads",
            "RACER_ROUND_THREADS",
            0,
            "threads of a native forward of at most 64 rows (a round's draft trees); larger ones (prefills) use "
            "--threads; 0: --threads for every call. racer stack sets it where the verifier's rounds have CPUs "
            "of their own and its prefills every CPU",
            int,
        ),
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
            True,
            "measure the cost curve at start-up for the adaptive budget (0: off)",
            bool,
        ),
        Setting("--topk", "RACER_TOPK", 8, "top-k ids returned per position", int),
        Setting("--session-ttl", "RACER_SESSION_TTL", 1800.0, "seconds an idle KV cache is kept", float),
        Setting("--max-sessions", "RACER_MAX_SESSIONS", 64, "KV caches kept; the least recently used goes first", int),
        Setting("--max-cache-tokens", "RACER_MAX_CACHE_TOKENS", 262_144, "tokens held in all KV caches together", int),
        ALLOW_UNAUTHENTICATED,
        Setting(
            "--kv-memory-bytes",
            "RACER_KV_MEMORY_BYTES",
            0,
            "bytes all KV caches may hold together (0: 60 percent of the cgroup memory limit left after the model's "
            "weights, or --max-cache-tokens tokens' worth without a limit)",
            int,
            old_flags=("--kv-budget-bytes",),
            old_envs=("RACER_KV_BUDGET_BYTES",),
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
            "--prompt-topk",
            "RACER_PROMPT_TOPK",
            256,
            "prompt positions, the last ones, whose top-k an open sends back (the drafter's copy-logit table; "
            "the output layer runs over those rows and the last one only); with --measure-cost, at most as "
            "many as cost one one-token step, measured at start-up; -1: every position, unbounded",
            int,
        ),
        Setting(
            "--prefix-cache",
            "RACER_PREFIX_CACHE",
            True,
            "keep the KV rows of prompts' leading blocks for the same tenant's later sessions (a new session "
            "copies the longest cached block prefix of its prompt and prefills the rest), in free KV memory; 0: off",
            bool,
        ),
        Setting(
            "--prefix-block-tokens",
            "RACER_PREFIX_BLOCK_TOKENS",
            64,
            "tokens per prefix-cache block: the unit of lookup, placement and eviction",
            int,
        ),
        Setting(
            "--prefix-fetch",
            "RACER_PREFIX_FETCH",
            "auto",
            "a new session's prompt blocks that another verifier holds (the gateway names it): fetched from it "
            "when that is faster than their prefill by this verifier's measured rates (auto), whenever named "
            "(always), or never (off)",
            choices=("auto", "always", "off"),
        ),
        Setting(
            "--prefix-fetch-seconds",
            "RACER_PREFIX_FETCH_SECONDS",
            10.0,
            "longest a transfer of prefix blocks may take (less when the client's deadline is sooner); past it "
            "the open prefills them",
            float,
        ),
        Setting(
            "--prefix-fetch-bytes",
            "RACER_PREFIX_FETCH_BYTES",
            1 << 30,
            "most bytes of prefix blocks one transfer may bring (also bounded by free KV memory)",
            int,
        ),
        Setting(
            "--prefix-warm-share",
            "RACER_PREFIX_WARM_SHARE",
            0.25,
            "share of KV memory a verifier that joins may fill with the hottest prefix blocks of a verifier "
            "the gateway names (Warm); 0: it is not warmed",
            float,
        ),
        Setting(
            "--stall-seconds",
            "RACER_STALL_SECONDS",
            60.0,
            "health turns NOT_SERVING (and new sessions are refused) when work has waited this long with no "
            "forward finished",
            float,
        ),
        Setting(
            "--tls-ca",
            "RACER_TLS_CA",
            "",
            "PEM CA bundle that signed the other verifiers' certificates, for this verifier's calls to them (KV "
            "transfers: fetch, hand-over, warm-up); set: it talks TLS to them",
        ),
        Setting(
            "--tls-client-cert",
            "RACER_TLS_CLIENT_CERT",
            "",
            "PEM certificate this verifier presents to other verifiers for KV transfers (for their --tls-client-ca)",
        ),
        Setting("--tls-client-key", "RACER_TLS_CLIENT_KEY", "", "PEM private key of --tls-client-cert"),
        Setting(
            "--tls-server-name",
            "RACER_TLS_SERVER_NAME",
            "",
            "name the other verifiers' certificates must carry, for this verifier's calls to them (KV transfers; "
            "default: the address's host; set it when verifiers reach each other at pod IPs)",
        ),
    ],
    "gateway": [
        Setting(
            "--model",
            "RACER_MODEL",
            "default",
            "tokenizer source: 'default', a Hugging Face model directory, a GGUF file (or a directory holding "
            "one), or 'none' (no tokenizer: clients send "
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
        Setting(
            "--verifier-runs",
            "RACER_VERIFIER_RUNS",
            True,
            "rounds without a draft tree (mode off, the adaptive budget resting) go to the verifier as one "
            "run: it verifies each round's token and goes on at the next by itself, answering every round, "
            "so those rounds take no request each (not with stop strings or a grammar); 0: a request per round",
            bool,
        ),
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
            "OpenAI-compatible HTTP API port (/v1/chat/completions, /v1/completions, /v1/models; 0: off; -1: a port "
            "the OS picks)",
            int,
        ),
        Setting(
            "--served-model-name",
            "RACER_SERVED_MODEL_NAME",
            "",
            "the model name the HTTP API lists and accepts (default: the --model directory's name)",
        ),
        Setting(
            "--chat-template",
            "RACER_CHAT_TEMPLATE",
            "",
            "a Jinja chat template file for every chat request (default: the model's own; a model without one, "
            "a base model, serves completions only; requests with tools use a shipped hermes-style template "
            "when the model's own cannot render tools)",
        ),
        Setting(
            "--tool-call-parser",
            "RACER_TOOL_CALL_PARSER",
            "hermes",
            "how tool calls are read from the model's text: hermes (JSON in <tool_call> tags) or pythonic "
            "([f(a=1), ...])",
            choices=("hermes", "pythonic"),
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


def port_settings(service: str) -> list[Setting]:
    port, metrics = PORTS[service]
    return [
        Setting("--port", "RACER_PORT", port, "gRPC port (0: a port the OS picks)", int),
        Setting(
            "--metrics-port",
            "RACER_METRICS_PORT",
            metrics,
            "Prometheus metrics HTTP port (0: off; -1: a port the OS picks)",
            int,
        ),
    ]


def settings_of(service: str) -> list[Setting]:
    """Every setting ``racer serve <service>`` takes."""
    return COMMON + SERVICE[service] + port_settings(service)


def env_names(service: str) -> set[str]:
    return {s.env for s in settings_of(service)}


def lookup(service: str, flag: str) -> Setting:
    for s in settings_of(service):
        if s.flag == flag:
            return s
    raise KeyError(f"{service}: no setting {flag}")


def default(service: str, flag: str) -> object:
    """The table's default of ``flag`` for ``service`` (commands that share a setting show the same default)."""
    return lookup(service, flag).default


def prompt_topk(n: int) -> int | None:
    """``--prompt-topk`` as the verifier takes it: the last ``n`` prompt positions, or None (every
    one) for a negative ``n``."""
    return None if n < 0 else n


def common_default(flag: str) -> object:
    """The table's default of a setting every service has (``--keepalive-seconds``)."""
    for s in COMMON:
        if s.flag == flag:
            return s.default
    raise KeyError(f"no common setting {flag}")


class _Store(argparse.Action):
    """Stores a flag's value; an old name of the flag warns."""

    def __init__(self, option_strings, dest, setting: Setting, **kw):
        super().__init__(option_strings, dest, **kw)
        self.setting = setting

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.setting.old_flags:
            deprecated(f"{option_string} is deprecated: use {self.setting.flag}")
        setattr(namespace, self.dest, values)


def _flag_type(s: Setting):
    def parse(raw: str) -> object:
        try:
            return s.parse(raw, s.flag)
        except SettingError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{s.flag}=")) from None

    parse.__name__ = s.type.__name__
    return parse


def _add(
    parser: argparse.ArgumentParser, s: Setting, default: object, where: str, shown: object, text: str = ""
) -> None:
    kw: dict = {"nargs": "?", "const": True} if s.type is bool else {}  # --flag alone, or --flag 0/1
    parser.add_argument(
        s.flag,
        *s.old_flags,
        dest=s.dest,
        type=_flag_type(s),
        default=default,
        action=_Store,
        setting=s,
        metavar="|".join(s.choices) if s.choices else s.type.__name__.upper(),
        help=f"{text or s.help} ({where}default {shown})",
        **kw,
    )


def add_arguments(parser: argparse.ArgumentParser, service: str) -> None:
    """Flags for ``service``. A flag not given stays unset in the parsed namespace: ``resolve`` fills it
    from its environment variable, then from the table."""
    for s in settings_of(service):
        _add(parser, s, argparse.SUPPRESS, f"env {s.env}; ", s.default)


@dataclass(frozen=True)
class FromEnv:
    """What a command's flag of ``add_flag`` holds until ``resolve_flags``: it was not given."""

    setting: Setting
    fallback: object  # the value without the flag or the variable

    def value(self, environ: Mapping[str, str]) -> object:
        names = (self.setting.env, *self.setting.old_envs)
        return self.setting.from_env(environ) if any(n in environ for n in names) else self.fallback


_TABLE = object()  # add_flag's default: the table's


def add_flag(
    parser: argparse.ArgumentParser, service: str, flag: str, default: object = _TABLE, help: str = ""
) -> None:
    """A command's own flag for a setting of ``service`` (``racer stack --dtype``): the table's type,
    choices and old names (and help, unless ``help`` says what it is to the command). Not given, it
    is what the service would read: the setting's variable (``RACER_DTYPE``), else ``default`` (the
    table's unless the command passes its own). The parser must be a ``CommandParser`` (or its
    namespace go through ``resolve_flags``)."""
    s = lookup(service, flag)
    fallback = s.default if default is _TABLE else default
    _add(parser, s, FromEnv(s, fallback), f"env {s.env}; ", fallback, help)


def resolve_flags(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Every flag of ``add_flag`` the command line left out: from its variable (``SettingError`` when
    malformed), else its default. Other values stay as they are."""
    environ = os.environ if environ is None else environ
    for name, value in vars(args).items():
        if isinstance(value, FromEnv):
            setattr(args, name, value.value(environ))
    return args


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose flags of ``add_flag`` are resolved as it parses (``resolve_flags``),
    its subcommands' too (they are parsers of this class)."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        return resolve_flags(ns), rest


def resolve(args: argparse.Namespace, service: str, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Fills every setting of ``service`` the command line left unset: from ``environ`` (the process's
    environment by default), else the table's default. ``SettingError`` on a malformed variable."""
    environ = os.environ if environ is None else environ
    for s in settings_of(service):
        if not hasattr(args, s.dest):
            setattr(args, s.dest, s.from_env(environ))
    return args


def parse(service: str, argv: list[str] = (), environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The settings of ``service`` as ``racer serve <service> ARGV`` would read them."""
    parser = argparse.ArgumentParser(prog=f"racer serve {service}")
    add_arguments(parser, service)
    return resolve(parser.parse_args(list(argv)), service, environ)
