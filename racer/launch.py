"""Builds and starts each service from its settings (common/settings.py): used by ``racer serve``,
``racer stack`` and the tests (which pass an already loaded model)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

from common.identity import PeerAuthInterceptor, load_tokens, require_peer_auth
from common.identity import metadata as identity_metadata
from common.server import Server, start_server
from common.tls import server_credentials

log = logging.getLogger("racer")


def _server_kw(args, kind: str = "gateway") -> dict:
    """What every service's gRPC server takes from the common settings. Drafters and verifiers also
    authenticate their callers (the gateways): an internal token, mutual TLS, or both."""
    kw = dict(
        credentials=server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca),
        keepalive_seconds=args.keepalive_seconds,
        health_port=getattr(args, "health_port", 0),
    )
    if kind != "gateway":
        tokens = internal_tokens(args)
        require_peer_auth(kind, tokens, args.tls_client_ca, bool(getattr(args, "allow_unauthenticated", 0)))
        kw["interceptors"] = [PeerAuthInterceptor(tokens)] if tokens else []
    return kw


def internal_tokens(args) -> tuple[str, ...]:
    return load_tokens(getattr(args, "internal_token", ""), getattr(args, "internal_token_file", ""))


def defaults(service: str, **overrides) -> SimpleNamespace:
    """The settings of ``service`` as ``racer serve`` would parse them with no flags, then ``overrides``."""
    import argparse

    from common.settings import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap, service)
    ns = ap.parse_args([])
    for k, v in overrides.items():
        if not hasattr(ns, k):
            raise TypeError(f"{service}: unknown setting {k!r}")
        setattr(ns, k, v)
    return ns


async def start_drafter(args) -> tuple[Server, object]:
    from common.priors import load_prior
    from common.sessions import janitor
    from common.store import open_store
    from common.v1 import drafter_pb2_grpc
    from drafter.corpora import Corpora
    from drafter.service import DrafterService
    from drafter.session import DrafterConfig
    from drafter.sessions import Drafter

    server_kw = _server_kw(args, "drafter")  # first: a drafter that cannot authenticate its callers never starts
    config = DrafterConfig(window=args.window, max_nodes=args.max_nodes, topk=args.topk)
    store = open_store(args.snapshot_url)
    core = Drafter(
        config,
        store,
        load_prior(args.prior, args.topk),
        args.snapshot_every,
        args.session_ttl,
        max_tokens=args.max_session_tokens,
        max_bytes=getattr(args, "max_memory_bytes", 0),
        corpora=Corpora(getattr(args, "corpus_tokens", 0), getattr(args, "corpus_idle", 600.0), store),
    )
    svc = DrafterService(core)
    tasks = []

    async def drain(grace: float):
        for t in tasks:
            t.cancel()
        svc.draining = True  # streams end at their next step, each after its snapshot is written
        await _streams_ended(core.sessions.streaming, grace)
        await core.flush()

    async def closed():
        await core.flush()  # what the streams that ran during the drain changed
        await store.close()

    srv = await start_server(
        "drafter",
        lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(svc, s),
        args.host,
        args.port,
        args.max_message_bytes,
        drain,
        closed=closed,
        **server_kw,
    )
    tasks.append(asyncio.ensure_future(janitor(core.expire, min(30.0, args.session_ttl))))
    tasks.append(asyncio.ensure_future(core.corpora.run()))
    return srv, core


async def start_verifier(args, model=None) -> tuple[Server, object]:
    from common.sessions import janitor
    from common.v1 import verifier_pb2_grpc
    from verifier.service import VerifierService
    from verifier.sessions import Verifier

    server_kw = _server_kw(args, "verifier")  # before the model loads: refused at once
    if model is None:
        from verifier.model import load, resolve_dtype

        device = "cuda" if args.device == "auto" and _cuda() else ("cpu" if args.device == "auto" else args.device)
        dtype = resolve_dtype(getattr(args, "dtype", "float32"), device)
        model = (await asyncio.to_thread(load, args.model, dtype, args.threads or None, False)).model
        if device != "cpu":
            model = model.to(device)
    if args.backend != "hf":
        from verifier.backends import FastLlamaBackend
        from verifier.kernels import plan_for

        if FastLlamaBackend.supports(model):  # kernels measured (or read from the cache) before serving
            plan = await asyncio.to_thread(plan_for, model)
            log.info("kernels", extra={"dtype": str(model.dtype), "choice": plan.describe()})
    cost = None
    if args.measure_cost:
        from verifier.engine import measure_cost

        cost = await asyncio.to_thread(measure_cost, model, backend=args.backend, topk=args.topk)
        log.info("cost curve", extra={"ms_by_size": {n: round(c, 2) for n, c in cost.items()}})
    core = Verifier(
        model,
        args.topk,
        args.backend,
        args.max_sessions,
        args.max_cache_tokens,
        args.session_ttl,
        cost,
        args.max_batch,
        args.max_wait_ms,
        kv_budget_bytes=args.kv_budget_bytes,
        headroom=args.kv_headroom_tokens,
        prefill_chunk=args.prefill_chunk,
        max_waiting=args.admission_queue,
        wait_seconds=args.admission_wait_seconds,
        stall_seconds=args.stall_seconds,
        prefill_batch=args.prefill_batch,
        prefill_lead=args.prefill_lead,
    )
    log.info(
        "KV budget",
        extra={"bytes": core.budget.total, "bytes_per_token": core.budget.per_token, "tokens": core.budget.tokens},
    )
    svc = VerifierService(core)
    tasks = []

    async def drain(grace: float):
        for t in tasks:
            t.cancel()
        svc.draining = True  # no new session; streams end after their round in flight (they move)
        t0 = time.monotonic()
        left = await _streams_ended(core.streaming, grace)
        log.info("drained", extra={"seconds": round(time.monotonic() - t0, 3), "streams_left": left})

    async def closed():  # after the last RPC: the model thread finishes its job and ends
        await asyncio.to_thread(core.model_thread.close)

    srv = await start_server(
        "verifier",
        lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(svc, s),
        args.host,
        args.port,
        args.max_message_bytes,
        drain,
        closed=closed,
        **server_kw,
    )
    tasks.append(asyncio.ensure_future(janitor(core.expire, min(30.0, args.session_ttl))))
    tasks.append(asyncio.ensure_future(watch_model_thread(core, srv)))
    from verifier import load
    from verifier import metrics as VM

    VM.SATURATION.set_function(lambda: load.of(core))
    return srv, core


async def _streams_ended(streaming, grace: float) -> int:
    """Waits (at most ``grace`` seconds) until ``streaming()`` is 0; returns what is left."""
    deadline = time.monotonic() + grace
    while streaming() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return streaming()


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


async def start_gateway(args, tokenizer=None, eos_ids=None, vocab_size=None, resolver=None) -> tuple[Server, object]:
    from common.server import channel_options
    from common.sessions import janitor
    from common.store import open_store
    from common.tls import channel_credentials
    from common.v1 import generation_pb2_grpc
    from gateway.admission import Queueing
    from gateway.auth import ApiKeys
    from gateway.core import Gateway, Timeouts
    from gateway.requests import Limits, request_bytes
    from gateway.routing import Endpoints
    from gateway.service import GatewayService

    if tokenizer is None and args.model != "none":
        from transformers import AutoConfig, AutoTokenizer

        from verifier.model import eos_token_ids, resolve_model_dir

        path = await asyncio.to_thread(resolve_model_dir, args.model)
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
        eos_ids = eos_token_ids(path, tokenizer)
        vocab_size = AutoConfig.from_pretrained(path).vocab_size
    opts = channel_options(args.max_message_bytes, args.keepalive_seconds, args.tls_server_name)
    creds = channel_credentials(args.tls_ca, args.tls_client_cert, args.tls_client_key)
    kw = {"resolver": resolver} if resolver else {}
    kw["metadata"] = identity_metadata(internal_tokens(args))  # sent with every call to a drafter or verifier
    drafters = Endpoints(args.drafters, args.resolve_every, channel_options=opts, credentials=creds, **kw)
    verifiers = Endpoints(args.verifiers, args.resolve_every, channel_options=opts, credentials=creds, **kw)
    await drafters.refresh(force=True)
    await verifiers.refresh(force=True)
    keys = ApiKeys(args.api_keys) if args.api_keys else None  # a bad file stops the start here
    _gauge_endpoints(drafters, verifiers)
    store = open_store(args.session_url)
    # Without API keys every turn is the one local tenant's: a per-tenant cap would be the whole
    # service's, below what the verifiers admit (they queue on KV memory and batch what runs).
    per_tenant = args.max_sessions_per_tenant if keys is not None else 0
    limits = Limits(args.max_prompt_tokens, args.max_new_tokens, args.max_budget, per_tenant)
    tenant_limits = _tenant_limits(args, per_tenant)
    queueing = Queueing(args.queue_max_waiters, args.queue_wait_seconds, args.queue_poll_seconds)
    timeouts = Timeouts(args.backend_timeout, args.reconnect_seconds, args.store_retry_seconds)
    core = Gateway(
        tokenizer,
        eos_ids or (),
        drafters,
        verifiers,
        store,
        keys,
        limits,
        args.session_ttl,
        vocab_size,
        timeouts,
        tenant_limits,
        getattr(args, "lease_seconds", 10.0),
        queueing,
    )

    tasks = []
    every = getattr(args, "api_keys_reload_seconds", 0.0)
    if keys is not None and every > 0:  # a changed key file (a rotated Secret) is read again without a restart

        async def reload_keys():
            keys.maybe_reload()

        tasks.append(asyncio.ensure_future(janitor(reload_keys, every)))

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
        min(args.max_message_bytes, request_bytes(limits)),
        core.drain,
        closed=closed,
        **_server_kw(args),
    )
    if keys is not None:
        srv.reload = keys.reload  # SIGHUP (common.server.serve_forever)
    if args.http_port:
        from gateway.openai_http import start_http

        try:
            http.append(
                await start_http(core, args.host, args.http_port, served_model_name(args), args.max_message_bytes)
            )
        except BaseException as e:
            await srv.stop(0)
            if isinstance(e, OSError):
                raise RuntimeError(f"gateway: cannot serve HTTP on {args.host}:{args.http_port} ({e})") from e
            raise
    srv.http_port = http[0].port if http else 0  # the bound port (tests ask for a free one)
    return srv, core


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
    from gateway.quotas import Quota, TenantLimits, load_tenant_limits

    default = Quota(args.max_sessions_kept, args.max_tokens_stored, turns)
    return load_tenant_limits(args.tenant_limits, default) if args.tenant_limits else TenantLimits(default)
