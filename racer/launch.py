"""Builds and starts each service from its settings (common/settings.py): used by ``racer serve``,
``racer stack`` and the tests (which pass an already loaded model).

Each ``start_*`` imports its own service's packages when it runs, so a process loads only the
service it serves (a drafter never imports torch)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable

from common import settings, tracing
from common.costs import ContextSlope
from common.cpus import confine
from common.identity import PeerAuthInterceptor, load_tokens, require_peer_auth
from common.identity import metadata as identity_metadata
from common.priors import load_prior
from common.server import (
    Server,
    channel_options,
    is_unix,
    serve_forever,
    setup_logging,
    start_metrics,
    start_server,
    write_ports_file,
)
from common.sessions import janitor
from common.store import open_store
from common.tls import channel_credentials, server_credentials
from common.v1 import drafter_pb2_grpc, generation_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger("racer")


def _server_kw(args, kind: str = "gateway") -> dict:
    """What every service's gRPC server takes from the common settings. Drafters and verifiers also
    authenticate their callers (the gateways): an internal token, mutual TLS, or both."""
    kw = dict(
        credentials=server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca),
        keepalive_seconds=args.keepalive_seconds,
        health_port=args.health_port,
    )
    if kind != "gateway":
        tokens = internal_tokens(args)
        require_peer_auth(kind, tokens, args.tls_client_ca, args.allow_unauthenticated)
        kw["interceptors"] = [PeerAuthInterceptor(tokens)] if tokens else []
    return kw


def _client_tls(args, servers: str) -> tuple[object, list]:
    """A service's calls to other services (the gateway's to drafters and verifiers, a verifier's to
    other verifiers): channel credentials from ``--tls-ca`` and ``--tls-client-cert``/``--tls-client-key``
    (None: plaintext) and the channel options, with ``--tls-server-name``. Settings that cannot work
    are refused here, at start (ValueError: one line)."""
    if args.tls_server_name and not args.tls_ca:
        raise ValueError(f"--tls-server-name needs --tls-ca (the CA that signed the {servers}' certificates)")
    credentials = channel_credentials(args.tls_ca, args.tls_client_cert, args.tls_client_key)
    return credentials, channel_options(args.max_message_bytes, args.keepalive_seconds, args.tls_server_name)


def internal_tokens(args) -> tuple[str, ...]:
    return load_tokens(args.internal_token, args.internal_token_file)


def defaults(service: str, **overrides) -> argparse.Namespace:
    """The settings of ``service`` as ``racer serve`` would read them with no flags, then ``overrides``."""
    ns = settings.parse(service)
    for k, v in overrides.items():
        if not hasattr(ns, k):
            raise TypeError(f"{service}: unknown setting {k!r}")
        setattr(ns, k, v)
    return ns


async def _start_backend(
    kind: str,
    args,
    svc,
    register: Callable,
    core,
    streaming: Callable[[], int],
    after_drain: Callable[[], Awaitable[None]] | None = None,
    after_streams: Callable[[float], Awaitable[int]] | None = None,
    closed: Callable[[], Awaitable[None]] | None = None,
    background: tuple[Callable[[Server], Awaitable[None]], ...] = (),
    server_kw: dict | None = None,
) -> Server:
    """A drafter's or verifier's server: ``svc`` registered by ``register``, the sessions' janitor and
    ``background`` tasks running beside it. On SIGTERM the tasks stop, ``svc`` refuses new work and
    the drain waits (at most its grace) until ``streaming()`` is 0, then ``after_streams`` (given the
    grace left: a verifier serves its moving sessions' hand-overs), then runs ``after_drain``."""
    tasks: list[asyncio.Future] = []

    async def drain(grace: float):
        for t in tasks:
            t.cancel()
        svc.draining = True  # new requests are refused; open streams end at their next step (they move)
        t0 = time.monotonic()
        left = await _streams_ended(streaming, grace)
        log.info("drained", extra={"service": kind, "seconds": round(time.monotonic() - t0, 3), "streams_left": left})
        if after_streams is not None:
            awaited = await after_streams(max(0.0, grace - (time.monotonic() - t0)))
            log.info(
                "handed over", extra={"service": kind, "seconds": round(time.monotonic() - t0, 3), "not_asked": awaited}
            )
        if after_drain is not None:
            await after_drain()

    srv = await start_server(
        kind,
        lambda s: register(svc, s),
        args.host,
        args.port,
        args.max_message_bytes,
        drain,
        closed=closed,
        **(server_kw or {}),
    )
    tasks.append(asyncio.ensure_future(janitor(core.expire, min(30.0, args.session_ttl))))
    tasks.extend(asyncio.ensure_future(task(srv)) for task in background)
    return srv


async def start_drafter(args) -> tuple[Server, object]:
    from drafter.core import Drafter
    from drafter.corpora import Corpora
    from drafter.draft_session import DrafterConfig
    from drafter.prefixes import SharedPrefixes
    from drafter.service import DrafterService

    server_kw = _server_kw(args, "drafter")  # first: a drafter that cannot authenticate its callers never starts
    store = open_store(args.snapshot_url)
    core = Drafter(
        config=DrafterConfig(
            window=args.window, max_nodes=args.max_nodes, topk=args.topk, logits_tree=args.logits_tree
        ),
        store=store,
        prior=load_prior(args.prior, args.topk),
        snapshot_every=args.snapshot_every,
        ttl=args.session_ttl,
        max_tokens=args.max_session_tokens,
        max_bytes=args.max_memory_bytes,
        corpora=Corpora(args.corpus_tokens, args.corpus_idle, store, args.corpus_ttl),
        prefixes=SharedPrefixes(args.window, args.topk, min_tokens=args.shared_prefix_tokens),
    )

    async def closed():
        await core.flush()  # what the streams that ran during the drain changed
        await store.close()

    srv = await _start_backend(
        "drafter",
        args,
        DrafterService(core),
        drafter_pb2_grpc.add_DrafterServicer_to_server,
        core,
        core.sessions.streaming,
        after_drain=core.flush,  # each stream's snapshot is written as it ends; then the rest
        closed=closed,
        background=(lambda srv: core.corpora.run(),),
        server_kw=server_kw,
    )
    return srv, core


async def load_model(args):
    """The target model of ``--model`` on ``--device`` in ``--dtype`` (``auto``: one the backend of
    ``--backend`` that will verify it takes: ``verifier.model.auto_dtype``)."""
    from verifier.model import load, resolve_dtype

    device = args.device
    if device == "auto":
        device = "cuda" if _cuda() else "cpu"
    dtype = resolve_dtype(args.dtype, device, args.model, args.backend)
    log.info("model", extra={"model": args.model, "dtype": dtype, "setting": args.dtype, "device": device})
    model = (await asyncio.to_thread(load, args.model, dtype, args.threads or None, False, args.backend)).model
    if device == "cpu":
        from verifier import native

        native.round_threads(args.round_threads)
    return model if device == "cpu" else model.to(device)


async def _measure(model, args) -> tuple[dict[int, float] | None, ContextSlope | None, int | None]:
    """Before serving: the llama backend's kernels (measured, or read from the cache) and, with
    ``--measure-cost``, the cost curve the adaptive budget reads; and the prompt rows an open sends
    the top-k of: ``--prompt-topk``'s last positions, with ``--measure-cost`` at most as many as cost
    one one-token step (``measure_prompt_rows``)."""
    from verifier.engine import measure_cost_slope, measure_prompt_rows
    from verifier.llama import LlamaBackend
    from verifier.tuning import kernel_plan

    if args.backend != "hf" and LlamaBackend.supports(model):
        plan = await asyncio.to_thread(kernel_plan, model)
        log.info("kernels", extra={"dtype": str(model.dtype), "choice": plan.describe()})
    rows = settings.prompt_topk(args.prompt_topk)
    if not args.measure_cost:
        return None, None, rows
    cost, slope = await asyncio.to_thread(measure_cost_slope, model, backend=args.backend, topk=args.topk)
    log.info(
        "cost curve",
        extra={
            "ms_by_size": {n: round(c, 2) for n, c in cost.items()},
            "context": slope.context if slope else None,
            "us_per_context_token": {n: round(v * 1e3, 3) for n, v in slope.per_token.items()} if slope else None,
        },
    )
    if rows:  # 0 needs no bound, and None (every position) asks for none
        step_ms = cost[min(cost)]
        bound = await asyncio.to_thread(measure_prompt_rows, model, step_ms, backend=args.backend, topk=args.topk)
        rows = rows if bound is None else min(rows, bound)
        log.info("prompt top-k rows", extra={"setting": args.prompt_topk, "within_one_step": bound, "rows": rows})
    return cost, slope, rows


async def start_verifier(args, model=None) -> tuple[Server, object]:
    from verifier import load as verifier_load
    from verifier import metrics as VM
    from verifier.engine import backend_for
    from verifier.service import PeerFetcher, VerifierService
    from verifier.sessions import Verifier

    server_kw = _server_kw(args, "verifier")  # before the model loads: refused at once
    peer_credentials, peer_options = _client_tls(args, "other verifiers")
    # Verifiers set up like this one would refuse its KV transfers (counted as source; the opens prefill).
    if args.tls_cert and not args.tls_ca:
        log.warning("this verifier serves TLS but calls other verifiers in plaintext (no --tls-ca)")
    elif args.tls_client_ca and not args.tls_client_cert:
        log.warning("this verifier requires client certificates but presents none to other verifiers")
    model = model if model is not None else await load_model(args)
    backend_for(model, args.backend)  # a backend that refuses the model or its dtype: refused now, not per session
    cost, slope, prompt_rows = await _measure(model, args)
    core = Verifier(
        model=model,
        topk=args.topk,
        backend=args.backend,
        max_sessions=args.max_sessions,
        max_cache_tokens=args.max_cache_tokens,
        ttl=args.session_ttl,
        cost=cost,
        slope=slope,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        kv_memory_bytes=args.kv_memory_bytes,
        headroom=args.kv_headroom_tokens,
        prefill_chunk=args.prefill_chunk,
        max_waiting=args.admission_queue,
        wait_seconds=args.admission_wait_seconds,
        stall_seconds=args.stall_seconds,
        prefill_batch=args.prefill_batch,
        prefill_lead=args.prefill_lead,
        prompt_topk=prompt_rows,
        prefix_cache=args.prefix_cache,
        prefix_block=args.prefix_block_tokens,
        prefix_fetch=args.prefix_fetch,
        prefix_fetch_seconds=args.prefix_fetch_seconds,
        prefix_fetch_bytes=args.prefix_fetch_bytes,
        prefix_warm_share=args.prefix_warm_share,
    )
    # Other verifiers' prefix blocks: asked with the internal token the gateways send (every verifier
    # accepts it), over TLS with --tls-ca (and this verifier's client certificate, for verifiers that
    # require one), else plaintext.
    fetcher = PeerFetcher(identity_metadata(internal_tokens(args)), peer_credentials, peer_options)
    core.fetcher = fetcher
    log.info(
        "KV memory",
        extra={
            "bytes": core.kv_memory.total,
            "bytes_per_token": core.kv_memory.per_token,
            "tokens": core.kv_memory.tokens,
        },
    )

    async def closed():  # after the last RPC: the model thread finishes its job and ends
        await fetcher.close()
        await asyncio.to_thread(core.model_thread.close)

    srv = await _start_backend(
        "verifier",
        args,
        VerifierService(core),
        verifier_pb2_grpc.add_VerifierServicer_to_server,
        core,
        core.streaming,
        after_streams=core.handed_over,  # the moving sessions' rows: served until asked for (bounded)
        closed=closed,
        background=(lambda srv: watch_model_thread(core, srv), lambda srv: trim_heap_when_idle(core)),
        server_kw=server_kw,
    )
    VM.SATURATION.set_function(lambda: verifier_load.of(core))
    return srv, core


async def _streams_ended(streaming, grace: float) -> int:
    """Waits (at most ``grace`` seconds) until ``streaming()`` is 0; returns what is left."""
    deadline = time.monotonic() + grace
    while streaming() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return streaming()


async def trim_heap_when_idle(core, period: float = 1.0) -> None:
    """The C heap's gauges every ``period`` seconds, and its free memory handed back once the verifier
    is idle (no stream open) after the model did work, and once after start-up: a wave's
    activations and buffers are not kept resident after the wave (``verifier/heap.py``)."""
    from verifier import heap

    trimmed = None  # the first idle check trims what start-up (loading, tuning) left free
    while True:
        await asyncio.sleep(period)
        done = core.model_thread.last_done
        if done != trimmed and not core.streaming():
            trimmed = done
            await asyncio.to_thread(heap.trim)
        heap.export()


async def watch_model_thread(core, srv: Server) -> None:
    """Health follows the model thread: NOT_SERVING while it has work and finished none for
    ``stall_seconds`` (load balancers and gateways then send new sessions elsewhere), SERVING again
    once it finishes one. A server shutting down stays NOT_SERVING (the health servicer ignores
    ``set`` from then on)."""
    from verifier import metrics as M

    period = max(0.02, min(1.0, core.stall_seconds / 4))
    was = False
    while True:
        stalled = core.stalled()
        if stalled != was:
            await srv.set_serving(not stalled)
            M.MODEL_STALLED.set(int(stalled))
            (log.error if stalled else log.info)(
                "model thread stalled" if stalled else "model thread running again",
                extra={"stall_seconds": core.stall_seconds},
            )
            was = stalled
        await asyncio.sleep(period)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def load_tokenizer(args) -> tuple[object, tuple[int, ...], int | None]:
    """(tokenizer, end-of-turn ids, vocabulary size) of ``--model``."""
    from transformers import AutoConfig, AutoTokenizer

    from verifier.model import eos_token_ids, tokenizer_dir

    path = await asyncio.to_thread(tokenizer_dir, args.model)  # a GGUF file's weights are not converted here
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
    return tokenizer, tuple(eos_token_ids(path, tokenizer)), AutoConfig.from_pretrained(path).vocab_size


async def _backend_endpoints(args, resolver=None):
    """The drafters' and the verifiers' ``Endpoints``, resolved once; every call to them carries the
    internal token."""
    from gateway.routing import Endpoints

    credentials, options = _client_tls(args, "drafters' and verifiers")
    kw = dict(
        channel_options=options,
        credentials=credentials,
        metadata=identity_metadata(internal_tokens(args)),
        **({"resolver": resolver} if resolver else {}),
    )
    drafters = Endpoints(args.drafters, args.resolve_every, **kw)
    verifiers = Endpoints(args.verifiers, args.resolve_every, **kw)
    await drafters.refresh(force=True)
    await verifiers.refresh(force=True)
    _gauge_endpoints(drafters, verifiers)
    return drafters, verifiers


def _gateway_core(args, tokenizer, eos_ids, vocab_size, drafters, verifiers, keys, store):
    from gateway.admission import Queueing
    from gateway.core import Gateway, Timeouts
    from gateway.requests import Limits
    from gateway.tools import load_template

    # Without API keys every turn is the one local tenant's: a per-tenant cap would be the whole
    # service's, below what the verifiers admit (they queue on KV memory and batch what runs).
    per_tenant = args.max_sessions_per_tenant if keys is not None else 0
    return Gateway(
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        drafters=drafters,
        verifiers=verifiers,
        store=store,
        api_keys=keys,
        limits=Limits(args.max_prompt_tokens, args.max_new_tokens, args.max_budget, per_tenant),
        ttl=args.session_ttl,
        vocab_size=vocab_size,
        timeouts=Timeouts(args.backend_timeout, args.reconnect_seconds, args.store_retry_seconds),
        tenant_limits=_tenant_limits(args, per_tenant),
        lease_s=args.lease_seconds,
        queueing=Queueing(args.queue_max_waiters, args.queue_wait_seconds, args.queue_poll_seconds),
        chat_template=load_template(args.chat_template),
        tool_parser=args.tool_call_parser,
        runs=args.verifier_runs,
    )


async def start_gateway(args, tokenizer=None, eos_ids=None, vocab_size=None, resolver=None) -> tuple[Server, object]:
    """``tokenizer`` (with ``eos_ids`` and ``vocab_size``): one already loaded, else ``--model``'s."""
    from gateway.auth import ApiKeys
    from gateway.requests import request_bytes
    from gateway.service import GatewayService

    if tokenizer is None and args.model != "none":
        tokenizer, eos_ids, vocab_size = await load_tokenizer(args)
    drafters, verifiers = await _backend_endpoints(args, resolver)
    keys = ApiKeys(args.api_keys) if args.api_keys else None  # a bad file stops the start here
    store = open_store(args.session_url)
    core = _gateway_core(args, tokenizer, eos_ids or (), vocab_size, drafters, verifiers, keys, store)
    tasks = []
    if keys is not None and args.api_keys_reload_seconds > 0:  # a changed key file (a rotated Secret) is read again
        tasks.append(asyncio.ensure_future(keys.watch(args.api_keys_reload_seconds)))

    http = []  # the OpenAI-compatible HTTP server, when --http-port is set

    async def closed():
        for t in tasks:
            t.cancel()
        for h in http:  # after the drain: its turns have ended
            await h.stop()
        await drafters.close()
        await verifiers.close()
        await store.close()

    svc = GatewayService(core)
    srv = await start_server(
        "gateway",
        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(svc, s),
        args.host,
        args.port,
        min(args.max_message_bytes, request_bytes(core.limits)),
        core.drain,
        closed=closed,
        **_server_kw(args),
    )
    if keys is not None:
        srv.reload = keys.reload  # SIGHUP (common.server.serve_forever)
    if args.http_port:  # ANY_PORT (-1): one the OS picks
        http.append(await _start_http(srv, core, args))
    srv.http_port = http[0].port if http else 0  # the bound port (tests ask for a free one)
    return srv, core


async def _start_http(srv: Server, core, args):
    """The OpenAI-compatible HTTP API beside the gRPC server ``srv`` (stopped if the HTTP one cannot start)."""
    from gateway.openai_http import start_http

    try:
        host = "0.0.0.0" if is_unix(args.host) else args.host
        return await start_http(core, host, max(args.http_port, 0), served_model_name(args), args.max_message_bytes)
    except BaseException as e:
        await srv.stop(0)
        if isinstance(e, OSError):
            raise RuntimeError(f"gateway: cannot serve HTTP on {args.host}:{args.http_port} ({e})") from e
        raise


def served_model_name(args) -> str:
    """The model name the HTTP API lists: ``--served-model-name``, else the model directory's name."""
    if args.served_model_name:
        return args.served_model_name
    if args.model == "default":
        return "SmolLM2-135M-Instruct"
    if args.model == "none":
        return "racer"
    from pathlib import Path

    return Path(args.model).resolve().name or "racer"


def _gauge_endpoints(drafters, verifiers) -> None:
    """``racer_gateway_healthy_endpoints{kind}``, read at each scrape (the alert on no healthy verifier)."""
    from gateway import metrics as M

    M.ENDPOINTS.labels("drafter").set_function(drafters.healthy)
    M.ENDPOINTS.labels("verifier").set_function(verifiers.healthy)


def _tenant_limits(args, turns: int):
    """The per-tenant quotas: the settings' defaults (``turns``: the default turns quota), then the
    tenant-limits file if one is named."""
    from dataclasses import replace

    from gateway.auth import LOCAL_TENANT
    from gateway.quotas import Quota, TenantLimits, load_tenant_limits

    default = Quota(args.max_sessions_kept, args.max_tokens_stored, turns)
    limits = load_tenant_limits(args.tenant_limits, default) if args.tenant_limits else TenantLimits(default)
    if not args.api_keys and LOCAL_TENANT not in dict(limits.tenants):
        # Without keys every caller is the one local tenant: a per-tenant count of kept sessions would
        # cap the whole server below what its verifiers admit. The file may still name it.
        local = replace(limits.of(LOCAL_TENANT), sessions=0)
        limits = TenantLimits(limits.default, (*limits.tenants, (LOCAL_TENANT, local)))
    return limits


def serve(args) -> int:
    """``racer serve <service>``: resolves its settings, starts it and serves until SIGTERM (then drains)."""
    settings.resolve(args, args.service)  # the flags not given, from RACER_* variables: SettingError names one
    setup_logging(args.log_level)
    try:
        confine(args.cpus)  # first: every thread started from here on inherits it
    except ValueError as e:
        print(f"racer serve {args.service}: --cpus: {e}", file=sys.stderr)
        return 2
    start = {"drafter": start_drafter, "verifier": start_verifier, "gateway": start_gateway}[args.service]
    tracing.setup(args.service, args.otlp_endpoint)  # before the servers: they add its interceptors

    async def go():
        try:
            srv, _ = await start(args)
            metrics = start_metrics(args.metrics_port, args.host)
            if args.ports_file:  # after every listener is up: a reader of the file may connect at once
                ports = {"grpc": srv.address, "port": srv.port, "health": srv.health_port, "metrics": metrics}
                write_ports_file(args.ports_file, dict(ports, http=getattr(srv, "http_port", 0)))
        except Exception as e:
            raise _NotStarted() from e
        await serve_forever(srv, args.drain_seconds)

    try:
        asyncio.run(go())
    except _NotStarted as e:
        return _not_started(args.service, e.__cause__)
    return 0


class _NotStarted(Exception):
    """A service's start-up failed (the cause is the error); once it serves, errors are not this."""


def _not_started(service: str, error: BaseException) -> int:
    """A service that cannot start: its last line says why (``racer.exits.fatal_line``), which is what
    ``racer stack`` and the other commands that start services report. A refusal (ValueError, a
    missing file: a setting, the model, a backend that does not take the dtype) is that line alone,
    exit 2; anything else is logged with its traceback first, exit 1."""
    from .exits import fatal_line

    refused = isinstance(error, (ValueError, FileNotFoundError))
    if not refused:
        log.error("start-up failed", extra={"service": service}, exc_info=error)
    print(fatal_line(service, str(error) if refused else f"{type(error).__name__}: {error}"), file=sys.stderr)
    return 2 if refused else 1
