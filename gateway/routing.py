"""Where a session's rounds go: drafters by rendezvous hashing, verifiers sticky.

Endpoints come from a static list (``host:port,host:port``) or a DNS name (``dns:///name:port``)
that resolves to many addresses (a Kubernetes headless Service: one per pod), re-resolved
periodically. Rendezvous (highest-random-weight) hashing means a session moves only when its own
drafter disappears, and then to the drafter that ranks next for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time
from typing import Callable

import grpc

from common import tracing

log = logging.getLogger("racer.gateway")


def rendezvous(key: str, endpoints: list[str]) -> list[str]:
    """``endpoints`` ranked for ``key``, best first (stable for a given set)."""

    def weight(ep: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{ep}".encode(), digest_size=8).digest()

    return sorted(endpoints, key=weight, reverse=True)


def parse_spec(spec: str) -> tuple[str | None, int | None, list[str]]:
    """``dns:///host:port`` -> (host, port, []); ``a:1,b:2`` -> (None, None, [a:1, b:2])."""
    spec = spec.strip()
    if spec.startswith("dns:"):
        target = spec[len("dns:") :].lstrip("/")
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"endpoint {spec!r}: expected dns:///name:port")
        return host, int(port), []
    eps = [e.strip() for e in spec.split(",") if e.strip()]
    if not eps:
        raise ValueError("no endpoints given")
    return None, None, eps


def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = []
    for family, _, _, _, addr in infos:
        ip = addr[0]
        out.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(set(out))


class Endpoints:
    """A live set of endpoints of one kind, with one channel per endpoint and local health marks."""

    def __init__(
        self,
        spec: str,
        resolve_every: float = 10.0,
        resolver: Callable[[str, int], list[str]] = _getaddrinfo,
        channel_options=None,
        down_for: float = 5.0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ):
        self.host, self.port, static = parse_spec(spec)
        self.metadata = metadata  # sent with every call: the internal token (common/identity.py)
        self.resolve_every = resolve_every
        self.resolver = resolver
        self.channel_options = channel_options or []
        self.credentials = credentials  # None: plaintext
        self.down_for = down_for
        self.endpoints: list[str] = static
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._down: dict[str, float] = {}  # endpoint -> monotonic time it may be tried again
        self._resolved_at = 0.0

    @property
    def dynamic(self) -> bool:
        return self.host is not None

    async def refresh(self, force: bool = False) -> list[str]:
        if self.dynamic and (force or time.monotonic() - self._resolved_at >= self.resolve_every):
            try:
                found = await asyncio.to_thread(self.resolver, self.host, self.port)
            except OSError as e:
                log.warning("endpoint resolution failed", extra={"host": self.host, "error": repr(e)})
                found = None
            self._resolved_at = time.monotonic()
            if found is not None:
                if set(found) != set(self.endpoints):
                    log.info("endpoints changed", extra={"host": self.host, "endpoints": found})
                self.endpoints = list(found)
                for ep in list(self._channels):
                    if ep not in found:
                        await self._channels.pop(ep).close()
        return self.endpoints

    def _up(self) -> list[str]:
        now = time.monotonic()
        return [e for e in self.endpoints if self._down.get(e, 0.0) <= now]

    def live(self) -> list[str]:
        return self._up() or list(self.endpoints)  # all marked down: try them anyway

    def healthy(self) -> int:
        """Endpoints known (for DNS: Ready pods behind a headless Service) and not marked down."""
        return len(self._up())

    def mark_down(self, endpoint: str) -> None:
        self._down[endpoint] = time.monotonic() + self.down_for

    def ranked(self, key: str, exclude=()) -> list[str]:
        return [e for e in rendezvous(key, self.live()) if e not in exclude]

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            # Tracing on: the turn's trace context travels in the streams' metadata.
            kw = dict(options=self.channel_options, interceptors=tracing.client_interceptors() or None)
            if self.credentials is not None:
                ch = grpc.aio.secure_channel(endpoint, self.credentials, **kw)
            else:
                ch = grpc.aio.insecure_channel(endpoint, **kw)
            self._channels[endpoint] = ch
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
