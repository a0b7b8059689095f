"""Key-value stores for session records and drafter snapshots: in memory or Redis.

``open_store("memory://")`` serves the local demo and tests; ``open_store("redis://host:6379/0")``
is the durable store replicas share. Values are bytes; every write carries a TTL.
"""

from __future__ import annotations

import time


class MemoryStore:
    """A dict with expiry, for one process (the local stack runs each service separately, so the
    drafter's memory store is that drafter's own)."""

    def __init__(self):
        self._data: dict[str, tuple[bytes, float]] = {}

    async def get(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] < time.monotonic():
            del self._data[key]
            return None
        return item[0]

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        self._data[key] = (bytes(value), time.monotonic() + ttl)

    async def delete(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    async def keys(self, prefix: str) -> list[str]:
        now = time.monotonic()
        return [k for k, (_, exp) in self._data.items() if k.startswith(prefix) and exp >= now]

    async def close(self) -> None:
        pass


class RedisStore:
    """Calls fail within a few seconds when Redis is down or hung (one quick retry covers a pooled
    connection that a Redis restart closed); callers decide what a failure costs: the gateway
    retries for a bounded time, the drafter skips the snapshot and counts it."""

    def __init__(self, url: str):
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff

        self._r = redis.Redis.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=2.0, retry=Retry(ExponentialBackoff(cap=0.25, base=0.05), 1)
        )

    async def get(self, key: str) -> bytes | None:
        return await self._r.get(key)

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        await self._r.set(key, value, px=max(1, int(ttl * 1000)))

    async def delete(self, key: str) -> bool:
        return bool(await self._r.delete(key))

    async def keys(self, prefix: str) -> list[str]:
        return [k.decode() async for k in self._r.scan_iter(match=_escape(prefix) + "*", count=500)]

    async def close(self) -> None:
        await self._r.aclose()


def _escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def open_store(url: str):
    if url in ("", "memory://", "memory"):
        return MemoryStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url)
    raise ValueError(f"store URL {url!r}: expected memory:// or redis://host:port/db")
