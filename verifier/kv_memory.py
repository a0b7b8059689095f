"""KV memory in bytes: what one cached token costs, how much the caches may hold, and who waits.

Every session's cache is a reservation of rows. Bytes are reserved before a cache grows and released
after it shrinks or is dropped, so the sum of reservations bounds what the caches hold at every
moment (``peak`` records the highest sum). A request that does not fit now waits in a bounded FIFO
queue: each release wakes the oldest waiters that fit. Idle caches are evicted (least recently used
first, through the ``evict`` callback) before anybody waits. No grpc: errors are ``Abort``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable

from common.errors import Abort, Status

from . import metrics as M

log = logging.getLogger("racer.verifier")

CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes one cached token takes: K and V of every layer, ``kv_heads * head_dim`` values each."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def memory_limit(path: Path = CGROUP_MEMORY_MAX) -> int | None:
    """The cgroup (v2) memory limit of this process in bytes, or None when there is none."""
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return None if raw == "max" or not raw.isdigit() else int(raw)


def default_kv_bytes(
    model, per_token: int, max_cache_tokens: int, fraction: float = 0.6, limit: int | None = None
) -> int:
    """KV memory without ``--kv-budget-bytes``: ``fraction`` of what the pod's memory limit leaves after the
    model's weights; without a limit, ``max_cache_tokens`` tokens' worth."""
    limit = memory_limit() if limit is None else limit
    if limit is None:
        return max_cache_tokens * per_token
    free = limit - model_bytes(model)
    if free <= 0:
        raise ValueError(f"the memory limit ({limit} bytes) does not hold the model ({model_bytes(model)} bytes)")
    return int(free * fraction)


@dataclass
class _Waiter:
    key: Hashable
    nbytes: int
    fut: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class KVMemory:
    """Reservations in bytes against ``total``, and the queue of those waiting for one.

    ``evict(keep)`` drops one idle cache (not ``keep``'s) and returns True, or returns False when
    none is left; it must release that cache's reservation.
    """

    def __init__(
        self,
        total: int,
        per_token: int,
        evict: Callable[[Hashable], bool] = lambda keep: False,
        max_waiting: int = 64,
        wait_seconds: float = 20.0,
    ):
        if total <= 0 or per_token <= 0:
            raise ValueError(f"KV memory: {total} bytes at {per_token} bytes per token")
        self.total = total
        self.per_token = per_token
        self.evict = evict
        self.max_waiting = max_waiting
        self.wait_seconds = wait_seconds
        self.held: dict[Hashable, int] = {}  # key -> bytes reserved
        self.used = 0
        self.peak = 0
        self._waiters: deque[_Waiter] = deque()
        self._waking = False
        M.KV_MEMORY_BYTES.set(total)

    @property
    def tokens(self) -> int:
        """Cached tokens KV memory holds in all."""
        return self.total // self.per_token

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.per_token

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.fut.done())

    def _set(self, key: Hashable, nbytes: int) -> None:
        self.used += nbytes - self.held.get(key, 0)
        self.held[key] = nbytes
        self.peak = max(self.peak, self.used)
        M.KV_RESERVED_BYTES.set(self.used)

    def try_reserve(self, key: Hashable, nbytes: int) -> bool:
        """Sets ``key``'s reservation to ``nbytes`` if that fits, evicting idle caches for it."""
        while self.used - self.held.get(key, 0) + nbytes > self.total:
            if not self.evict(key):
                return False
        self._set(key, nbytes)
        return True

    def shrink(self, key: Hashable, nbytes: int) -> None:
        """After ``key``'s cache shrank to ``nbytes`` (or less): the rest goes to those waiting."""
        if key in self.held and nbytes < self.held[key]:
            self._set(key, nbytes)
            self.wake()

    def release(self, key: Hashable) -> None:
        """After ``key``'s cache was dropped."""
        if key in self.held:
            self.used -= self.held.pop(key)
            M.KV_RESERVED_BYTES.set(self.used)
            self.wake()

    async def reserve(self, key: Hashable, nbytes: int, timeout: float | None, what: str) -> None:
        """Reserves ``nbytes`` for ``key`` (its whole reservation, not an increment): at once when it
        fits, else after waiting in the queue for at most ``timeout`` seconds (and ``wait_seconds``).
        RESOURCE_EXHAUSTED when it can never fit, when the queue is full, or when the wait runs out."""
        if nbytes > self.total:
            M.ADMISSIONS.labels("never_fits").inc()
            raise Abort(
                Status.RESOURCE_EXHAUSTED,
                f"{what}: needs {nbytes} bytes of KV memory, this verifier has {self.total} in all",
            )
        if not self._waiters and self.try_reserve(key, nbytes):  # nobody ahead in the queue
            M.ADMISSIONS.labels("now").inc()
            return
        if self.waiting >= self.max_waiting:
            M.ADMISSIONS.labels("queue_full").inc()
            raise Abort(
                Status.RESOURCE_EXHAUSTED,
                f"{what}: KV memory is full and {self.waiting} requests already wait for it",
            )
        wait = self.wait_seconds if timeout is None else max(0.0, min(timeout, self.wait_seconds))
        w = _Waiter(key, nbytes)
        self._waiters.append(w)
        M.ADMISSION_WAITING.set(self.waiting)
        self.wake()  # it may fit already (the head may be this one)
        try:
            async with asyncio.timeout(wait):
                await asyncio.shield(w.fut)
        except TimeoutError:
            if not w.fut.done():
                M.ADMISSIONS.labels("timed_out").inc()
                raise Abort(
                    Status.RESOURCE_EXHAUSTED,
                    f"{what}: waited {wait:g} s for {nbytes} bytes of KV memory "
                    f"({self.used} of {self.total} reserved by caches in use)",
                ) from None
        finally:
            if not w.fut.done():
                w.fut.cancel()  # the queue skips it
            self._drop_done()
        M.ADMISSIONS.labels("queued").inc()

    def _drop_done(self) -> None:
        while self._waiters and self._waiters[0].fut.done():
            self._waiters.popleft()
        M.ADMISSION_WAITING.set(self.waiting)
        self.wake()

    def wake(self) -> None:
        """Admits the oldest waiters that fit, in order (a big request is not passed by small ones);
        also after a cache turned idle (evictable)."""
        if self._waking:  # an eviction made for the head waiter releases (and wakes) from inside
            return
        self._waking = True
        try:
            while self._waiters:
                w = self._waiters[0]
                if w.fut.done():
                    self._waiters.popleft()
                    continue
                if not self.try_reserve(w.key, w.nbytes):
                    break
                self._waiters.popleft()
                w.fut.set_result(None)
        finally:
            self._waking = False
        M.ADMISSION_WAITING.set(self.waiting)
