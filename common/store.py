"""Key-value stores for session records and drafter snapshots: in memory or Redis.

``open_store("memory://")`` serves the local demo and tests; ``open_store("redis://host:6379/0")``
is the durable store replicas share. Values are bytes; every write carries a TTL.

Besides get/set/delete, both stores give the same atomic operations for a single writer per key:
a lease (a random token under a key with a TTL: ``acquire``, ``renew``, ``release``) and a fenced
compare-and-set (``fenced_set``: writes only while the lease holds the caller's token and the value
is still the one the caller read), so a writer whose lease expired or was taken cannot overwrite.
The Redis store runs them as Lua scripts; extra scripts (``script``) serve other atomic counters.
Both also carry notices between their users (``publish`` and ``listen``: Redis pub/sub, at most once).

Capped streams (``xadd``, ``xread``, ``xtrim``) carry what every replica must see in order, such as a
tenant corpus; a stream expires ``ttl`` seconds after its last write. ``incr`` counts epochs.
"""

from __future__ import annotations

import asyncio
import fnmatch
import time


class MemoryStore:
    """A dict with expiry, for one process (the local stack runs each service separately, so the
    drafter's memory store is that drafter's own)."""

    def __init__(self):
        self._data: dict[str, tuple[bytes, float]] = {}
        self._streams: dict[str, list[tuple[int, bytes]]] = {}
        self._stream_expiry: dict[str, float] = {}  # stream -> when it expires (monotonic)
        self._seq = 0
        self._listeners: list[tuple[str, asyncio.Queue]] = []  # (channel pattern, its listener's channels)

    async def publish(self, channel: str) -> None:
        for pattern, q in self._listeners:
            if fnmatch.fnmatchcase(channel, pattern):
                q.put_nowait(channel)

    async def listen(self, pattern: str):
        """The channels published on that match ``pattern`` (glob), as they are published."""
        q: asyncio.Queue = asyncio.Queue()
        entry = (pattern, q)
        self._listeners.append(entry)
        try:
            while True:
                yield await q.get()
        finally:
            self._listeners.remove(entry)

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

    async def acquire(self, key: str, token: str, ttl: float) -> bool:
        """Sets ``key`` to ``token`` if it is absent (or expired); whether ``key`` now holds ``token``
        (a retried call finds its own)."""
        held = await self.get(key)
        if held is not None:
            return held == token.encode()
        await self.set(key, token.encode(), ttl)
        return True

    async def renew(self, key: str, token: str, ttl: float) -> bool:
        """Extends ``key``'s TTL if it still holds ``token``."""
        if await self.get(key) != token.encode():
            return False
        await self.set(key, token.encode(), ttl)
        return True

    async def release(self, key: str, token: str) -> bool:
        """Deletes ``key`` if it still holds ``token``."""
        if await self.get(key) != token.encode():
            return False
        return await self.delete(key)

    async def fenced_set(self, lease: str, token: str, key: str, old: bytes | None, value: bytes, ttl: float) -> bool:
        """Sets ``key`` to ``value`` only if ``lease`` holds ``token`` and ``key`` holds ``old`` (None:
        absent); whether it did."""
        if await self.get(lease) != token.encode() or await self.get(key) != old:
            return False
        await self.set(key, value, ttl)
        return True

    async def xadd(self, key: str, data: bytes, maxlen: int, ttl: float) -> str:
        """Appends ``data`` to the stream ``key``, keeping about its last ``maxlen`` entries; the whole
        stream expires ``ttl`` seconds after this write (each write sets it again). The entry id."""
        self._seq += 1
        entries = self._live_stream(key)
        self._streams[key] = entries
        entries.append((self._seq, bytes(data)))
        del entries[: max(0, len(entries) - maxlen)]
        self._stream_expiry[key] = time.monotonic() + ttl
        return f"{self._seq}-0"

    async def xread(self, after: dict[str, str], count: int) -> dict[str, list[tuple[str, bytes]]]:
        """Up to ``count`` entries per stream after the given ids ("0": from the start), oldest first."""
        out = {}
        for key, last in after.items():
            n = int(last.split("-")[0])
            got = [(f"{i}-0", d) for i, d in self._live_stream(key) if i > n][:count]
            if got:
                out[key] = got
        return out

    async def xtrim(self, key: str, min_id: str) -> int:
        """Drops the stream's entries older than ``min_id``; how many."""
        n = int(min_id.split("-")[0])
        entries = self._live_stream(key)
        keep = [(i, d) for i, d in entries if i >= n]
        if key in self._streams:
            self._streams[key] = keep
        return len(entries) - len(keep)

    async def xdelete(self, key: str) -> bool:
        self._stream_expiry.pop(key, None)
        return self._streams.pop(key, None) is not None

    async def pttl(self, key: str) -> int:
        """Milliseconds before ``key`` (a value or a stream) expires; -2 if there is none."""
        if self._live_stream(key):
            return max(0, int((self._stream_expiry[key] - time.monotonic()) * 1000))
        item = self._data.get(key)
        if item is None or item[1] < time.monotonic():
            return -2
        return max(0, int((item[1] - time.monotonic()) * 1000))

    def _live_stream(self, key: str) -> list[tuple[int, bytes]]:
        if self._stream_expiry.get(key, float("inf")) < time.monotonic():
            self._streams.pop(key, None)
            self._stream_expiry.pop(key, None)
        return self._streams.get(key, [])

    async def incr(self, key: str) -> int:
        n = int((await self.get(key)) or 0) + 1
        await self.set(key, str(n).encode(), 10 * 365 * 86400)
        return n

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
        self._renew = self._r.register_script(_RENEW)
        self._release = self._r.register_script(_RELEASE)
        self._fenced_set = self._r.register_script(_FENCED_SET)

    async def get(self, key: str) -> bytes | None:
        return await self._r.get(key)

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        await self._r.set(key, value, px=max(1, int(ttl * 1000)))

    async def delete(self, key: str) -> bool:
        return bool(await self._r.delete(key))

    async def keys(self, prefix: str) -> list[str]:
        return [k.decode() async for k in self._r.scan_iter(match=_escape(prefix) + "*", count=500)]

    async def acquire(self, key: str, token: str, ttl: float) -> bool:
        if await self._r.set(key, token, px=_ms(ttl), nx=True):
            return True
        # A retried call whose first SET reached Redis but whose reply was lost finds its own token.
        return await self._r.get(key) == token.encode()

    async def renew(self, key: str, token: str, ttl: float) -> bool:
        return bool(await self._renew(keys=[key], args=[token, _ms(ttl)]))

    async def release(self, key: str, token: str) -> bool:
        return bool(await self._release(keys=[key], args=[token]))

    async def fenced_set(self, lease: str, token: str, key: str, old: bytes | None, value: bytes, ttl: float) -> bool:
        args = [token, "1" if old is None else "0", old or b"", value, _ms(ttl)]
        return bool(await self._fenced_set(keys=[lease, key], args=args))

    async def xadd(self, key: str, data: bytes, maxlen: int, ttl: float) -> str:
        async with self._r.pipeline(transaction=True) as p:  # the entry and its stream's expiry together
            p.xadd(key, {"d": data}, maxlen=maxlen, approximate=True)
            p.pexpire(key, _ms(ttl))
            entry_id, _ = await p.execute()
        return entry_id.decode()

    async def xread(self, after: dict[str, str], count: int) -> dict[str, list[tuple[str, bytes]]]:
        if not after:
            return {}
        out = {}
        for key, entries in await self._r.xread(after, count=count) or []:
            out[key.decode()] = [(i.decode(), f.get(b"d", b"")) for i, f in entries]
        return out

    async def xtrim(self, key: str, min_id: str) -> int:
        return int(await self._r.xtrim(key, minid=min_id, approximate=False))

    async def xdelete(self, key: str) -> bool:
        return bool(await self._r.delete(key))

    async def pttl(self, key: str) -> int:
        return int(await self._r.pttl(key))

    async def incr(self, key: str) -> int:
        return int(await self._r.incr(key))

    async def publish(self, channel: str) -> None:
        await self._r.publish(channel, b"")

    async def listen(self, pattern: str):
        """The channels published on that match ``pattern`` (glob), on a connection of its own; a
        notice published while it reconnects is lost."""
        ps = self._r.pubsub(ignore_subscribe_messages=True)
        try:
            await ps.psubscribe(pattern)
            while True:
                # a bounded read: the connection's socket timeout would end a blocking one
                m = await ps.get_message(timeout=1.0)
                if m is not None and m["type"] == "pmessage":
                    yield m["channel"].decode()
        finally:
            await ps.aclose()

    def script(self, lua: str):
        """A Lua script registered with this Redis: ``await s(keys=[...], args=[...])``."""
        return self._r.register_script(lua)

    async def close(self) -> None:
        await self._r.aclose()


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_FENCED_SET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local cur = redis.call('GET', KEYS[2])
if ARGV[2] == '1' then
  if cur then return 0 end
elseif cur ~= ARGV[3] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
return 1
"""


def _escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def open_store(url: str):
    if url in ("", "memory://", "memory"):
        return MemoryStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url)
    raise ValueError(f"store URL {url!r}: expected memory:// or redis://host:port/db")
