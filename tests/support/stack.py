"""Services in this process on a background event loop, real gRPC on loopback, and a real Redis.

The stack itself is ``racer/bench/inproc.py`` (the benchmark scripts start it too). Redis: a
``redis-server`` started here (scripts/setup.sh installs it), or a container through testcontainers
when a Docker engine is reachable instead. Neither: the tests fail and say so.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from racer.bench.inproc import (
    BACKEND_METADATA,
    INTERNAL_TOKEN,
    LoopThread,
    Stack,
    start_drafter,
    start_gateway,
    start_stack,
)
from racer.bench.tiny import prompt
from racer.procs import RedisServer

__all__ = [
    "BACKEND_METADATA",
    "INTERNAL_TOKEN",
    "LoopThread",
    "Stack",
    "backend_channel",
    "prompt",
    "redis_server",
    "start_drafter",
    "start_gateway",
    "start_stack",
    "wait_until",
]


class _WithToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the internal token to every call on a channel (what the gateway does on its own)."""

    def _with(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + BACKEND_METADATA)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with(details), request)

    intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = intercept_unary_unary


def backend_channel(target: str) -> grpc.Channel:
    """A plaintext channel to a drafter or verifier of these tests that sends ``INTERNAL_TOKEN``."""
    return grpc.intercept_channel(grpc.insecure_channel(target), _WithToken())


@contextlib.contextmanager
def redis_server():
    """A Redis for the tests (no persistence): yields its URL."""
    if shutil.which("redis-server"):
        with tempfile.TemporaryDirectory(prefix="racer-redis-") as workdir:
            server = RedisServer(Path(workdir), appendonly=False).start()
            try:
                yield server.url
            finally:
                server.stop()
        return
    try:
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7-alpine") as c:
            yield f"redis://{c.get_container_host_ip()}:{c.get_exposed_port(6379)}/0"
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"no redis-server on PATH and no Docker engine for testcontainers ({e!r}); run scripts/setup.sh")


def wait_until(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout} s")
