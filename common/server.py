"""What every service process shares: the gRPC server with health, reflection and the error
interceptor, Prometheus metrics, JSON logs, and a graceful shutdown on SIGTERM/SIGINT.

Shutdown: health flips to NOT_SERVING (load balancers stop sending), the service's ``drain`` hook
runs (the drafter flushes snapshots), and in-flight RPCs get ``drain_seconds`` to finish before the
server cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import sys
import time
from typing import Awaitable, Callable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from . import tracing
from .errors import Abort
from .logs import log_bug
from .settings import HEALTH_SERVICES, common_default

log = logging.getLogger("racer")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call that raised ``Abort`` with its status and message, for unary and streaming
    handlers alike: the servicers raise, and none of them catches to call ``context.abort``.

    Any other exception is a bug: it is logged with its traceback and an id, and the caller gets
    ``INTERNAL`` with that id and nothing of the exception (no internal details leave the process).

    Streaming handlers come in two styles: async generators (the services' own) and coroutines that
    send with ``context.write`` (grpc's health ``Watch``); each is wrapped in its own style, and
    anything else (a synchronous handler) passes through untouched."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        behavior = getattr(handler, kind)
        method = handler_call_details.method
        if inspect.isasyncgenfunction(behavior):

            async def call(request, context):
                try:
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for response in responses:
                            yield response
                except Abort as e:
                    await _abort(context, e)
                except grpc.aio.AbortError:  # the handler aborted the call itself
                    raise
                except Exception:  # noqa: BLE001 - a bug: logged here, generic to the caller
                    await context.abort(grpc.StatusCode.INTERNAL, log_bug(log, "an RPC handler", method=method))

        elif inspect.iscoroutinefunction(behavior):

            async def call(request, context):
                try:
                    return await behavior(request, context)
                except Abort as e:
                    await _abort(context, e)
                except grpc.aio.AbortError:
                    raise
                except Exception:  # noqa: BLE001
                    await context.abort(grpc.StatusCode.INTERNAL, log_bug(log, "an RPC handler", method=method))

        else:
            return handler
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(
            call, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


async def _abort(context, e: Abort) -> None:
    """Ends the call with ``e``'s status; a retry hint travels as trailing metadata (``retry-after``
    in seconds, as in HTTP, and ``grpc-retry-pushback-ms``, which gRPC's own retry policy honours)
    and as a ``google.rpc.RetryInfo`` in the status details (``grpc-status-details-bin``)."""
    code = grpc.StatusCode[e.code.name]
    if e.retry_after is None:
        await context.abort(code, e.message)
        return
    ms = max(1, round(e.retry_after * 1000))
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=ms // 1000, nanos=ms % 1000 * 10**6))
    detail = any_pb2.Any()
    detail.Pack(info)
    details = status_pb2.Status(code=code.value[0], message=e.message, details=[detail]).SerializeToString()
    md = (
        ("retry-after", str(-(-ms // 1000))),
        ("grpc-retry-pushback-ms", str(ms)),
        ("grpc-status-details-bin", details),
    )
    await context.abort(code, e.message, md)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``extra={...}`` fields are kept as keys."""

    _skip = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _common_options(max_message_bytes: int, keepalive_seconds: float) -> list[tuple[str, object]]:
    """Both ends: message size limits (a larger message gets RESOURCE_EXHAUSTED) and keepalive: a
    peer that stops answering pings (a frozen or partitioned process) is dropped and its streams end."""
    ka = max(1, int(keepalive_seconds * 1000))
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", ka),
        ("grpc.keepalive_timeout_ms", ka),
        ("grpc.http2.ping_timeout_ms", ka),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(
    max_message_bytes: int, keepalive_seconds: float = common_default("--keepalive-seconds")
) -> list[tuple[str, object]]:
    """The common limits and keepalive; clients (the gateway) ping as often as a server does, which
    it accepts rather than answer "too many pings"."""
    ping = min(max(1, int(keepalive_seconds * 1000)), 5000)
    return _common_options(max_message_bytes, keepalive_seconds) + [
        ("grpc.so_reuseport", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", ping),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", ping),
    ]


def channel_options(
    max_message_bytes: int, keepalive_seconds: float = common_default("--keepalive-seconds"), server_name: str = ""
) -> list[tuple[str, object]]:
    """The gateway's channels to drafters and verifiers: the common limits and keepalive, and a short
    reconnect backoff (at most 1 s), so a restarted pod is used again as soon as it listens."""
    opts = _common_options(max_message_bytes, keepalive_seconds) + [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return opts


class Server:
    """A started gRPC server for one service kind, with health and reflection registered."""

    def __init__(
        self,
        kind: str,
        server: grpc.aio.Server,
        port: int,
        health_servicer,
        drain: Callable[[float], Awaitable[None]] | None,
        closed: Callable[[], Awaitable[None]] | None = None,
        health_server: grpc.aio.Server | None = None,
        health_port: int = 0,
    ):
        self.kind = kind
        self.server = server
        self.port = port
        self.health_server = health_server  # plaintext, health only (probes when the main port needs TLS)
        self.health_port = health_port
        self.address = ""  # what clients dial: host:port, or unix:PATH
        self.health = health_servicer
        self._drain = drain
        self._closed = closed
        self._stopped = asyncio.Event()
        self.reload: Callable[[], object] | None = None  # what SIGHUP does (the gateway: read its API keys again)

    async def set_serving(self, serving: bool) -> None:
        """The overall ("") and the service's own health status (ignored once shutting down)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", HEALTH_SERVICES[self.kind]):
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful: NOT_SERVING, drain hook, then in-flight RPCs get what is left of ``grace``
        seconds (the hook gets the whole grace; the gateway's uses it to end its turns cleanly)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        deadline = time.monotonic() + grace
        await self.health.enter_graceful_shutdown()
        if self._drain is not None:
            try:
                await self._drain(grace)
            except Exception:  # noqa: BLE001 - shutdown goes on; the failure is logged
                log.exception("drain hook failed", extra={"service": self.kind})
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self._closed is not None:  # after the last RPC: release what the streams used
            await self._closed()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    kind: str,
    register: Callable[[grpc.aio.Server], None],
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = common_default("--max-message-bytes"),
    drain: Callable[[float], Awaitable[None]] | None = None,
    interceptors=None,
    credentials: grpc.ServerCredentials | None = None,
    keepalive_seconds: float = common_default("--keepalive-seconds"),
    closed: Callable[[], Awaitable[None]] | None = None,
    health_port: int = 0,
) -> Server:
    """``health_port`` (not 0): ``grpc.health.v1`` alone, in plaintext, on that port too, for
    probes that cannot present a client certificate (the kubelet's native gRPC probe) when the main
    port serves mutual TLS; it answers nothing but SERVING or NOT_SERVING."""
    server = grpc.aio.server(
        options=server_options(max_message_bytes, keepalive_seconds),
        # Tracing outermost: its span sees the status the error interceptor sets.
        interceptors=[*tracing.server_interceptors(), ErrorInterceptor(), *(interceptors or ())],
    )
    register(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    name = HEALTH_SERVICES[kind]
    reflection.enable_server_reflection((name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = listen_address(host, port)
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise RuntimeError(f"{kind}: cannot bind {address}")
    if is_unix(host):
        bound = 0  # no TCP port: the socket's path is the address
    health_server, health_bound = None, 0
    if health_port:
        if is_unix(host):
            raise RuntimeError(f"{kind}: --health-port needs a TCP --host, not {host}")
        health_server = grpc.aio.server(options=server_options(64 * 1024, keepalive_seconds))
        health_pb2_grpc.add_HealthServicer_to_server(hs, health_server)
        health_bound = health_server.add_insecure_port(f"{host}:{max(health_port, 0)}")
        if health_bound == 0:
            raise RuntimeError(f"{kind}: cannot bind the health port {host}:{health_port}")
    await server.start()
    if health_server is not None:
        await health_server.start()
    srv = Server(kind, server, bound, hs, drain, closed, health_server, health_bound)
    srv.address = address if is_unix(host) else f"{host}:{bound}"
    await srv.set_serving(True)
    log.info(
        "serving",
        extra={
            "service": kind,
            "address": srv.address,
            "port": bound or None,
            "tls": credentials is not None,
            "health_port": health_bound or None,
        },
    )
    return srv


# A port setting's value that asks the OS for a free port (0 turns an optional listener off); the
# port it got is logged and written to --ports-file.
ANY_PORT = -1


def is_unix(host: str) -> bool:
    """Whether ``host`` names a Unix domain socket (``unix:PATH``) instead of an address to bind a port on."""
    return host.startswith("unix:")


def listen_address(host: str, port: int) -> str:
    """gRPC's listening address for ``--host`` and ``--port``: ``unix:PATH`` as it is (no port), else
    ``host:port`` (port 0 or ``ANY_PORT``: one the OS picks)."""
    return host if is_unix(host) else f"{host}:{max(port, 0)}"


def start_metrics(port: int, host: str = "0.0.0.0") -> int:
    """The Prometheus endpoint on ``port`` (0: off; ``ANY_PORT``: one the OS picks) of ``host`` (all
    interfaces when ``host`` is a Unix socket); the port it listens on, 0 when off."""
    if not port:
        return 0
    server, _ = start_http_server(max(port, 0), addr="0.0.0.0" if is_unix(host) else host)
    return server.server_port


def write_ports_file(path: str, ports: dict[str, object]) -> None:
    """``ports`` (what this process listens on) as JSON in ``path``, written whole or not at all (a
    reader polling for the file never sees half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(ports, f)
    os.replace(tmp, path)


async def serve_forever(srv: Server, drain_seconds: float) -> None:
    """Runs until SIGTERM/SIGINT, then shuts down gracefully; SIGHUP calls ``srv.reload``."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if srv.reload is not None:
        loop.add_signal_handler(signal.SIGHUP, srv.reload)
    waiter = asyncio.ensure_future(srv.wait())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        t0 = time.monotonic()
        log.info("shutting down", extra={"service": srv.kind, "drain_seconds": drain_seconds})
        await srv.stop(drain_seconds)
        log.info("stopped", extra={"service": srv.kind, "seconds": round(time.monotonic() - t0, 3)})
    stopper.cancel()
    waiter.cancel()
