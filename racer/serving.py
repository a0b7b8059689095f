"""What every service process shares: the gRPC server with health and reflection, Prometheus
metrics, JSON logs, and a graceful shutdown on SIGTERM/SIGINT.

Shutdown: health flips to NOT_SERVING (load balancers stop sending), the service's ``drain`` hook
runs (the drafter flushes snapshots), and in-flight RPCs get ``drain_seconds`` to finish before the
server cancels what is left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .settings import HEALTH_SERVICES

log = logging.getLogger("racer")


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


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


class Server:
    """A started gRPC server for one service kind, with health and reflection registered."""

    def __init__(self, kind: str, server: grpc.aio.Server, port: int, health_servicer, drain: Callable[[], Awaitable[None]] | None):
        self.kind = kind
        self.server = server
        self.port = port
        self.health = health_servicer
        self._drain = drain
        self._stopped = asyncio.Event()

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful: NOT_SERVING, drain hook, then in-flight RPCs get ``grace`` seconds."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        await self.health.enter_graceful_shutdown()
        if self._drain is not None:
            try:
                await self._drain()
            except Exception:  # noqa: BLE001 - shutdown goes on; the failure is logged
                log.exception("drain hook failed", extra={"service": self.kind})
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    kind: str,
    register: Callable[[grpc.aio.Server], None],
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = 16 * 1024 * 1024,
    drain: Callable[[], Awaitable[None]] | None = None,
    interceptors=None,
) -> Server:
    server = grpc.aio.server(options=server_options(max_message_bytes), interceptors=interceptors)
    register(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    name = HEALTH_SERVICES[kind]
    reflection.enable_server_reflection((name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"{kind}: cannot bind {host}:{port}")
    await server.start()
    for svc in ("", name):
        await hs.set(svc, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", extra={"service": kind, "port": bound})
    return Server(kind, server, bound, hs, drain)


def start_metrics(port: int) -> None:
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)


async def serve_forever(srv: Server, drain_seconds: float) -> None:
    """Runs until SIGTERM/SIGINT, then shuts down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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


async def wait_healthy(target: str, service: str = "", timeout: float = 120.0) -> None:
    """Polls ``grpc.health.v1`` at ``target`` until SERVING or ``timeout``."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} not healthy after {timeout:.0f} s")
            await asyncio.sleep(0.2)
