"""Turns over their tenant's running-turns limit wait their turn instead of failing.

A turn that finds its tenant's turns full (the store's ``turns`` quota, counted across gateways, or
this gateway's ``max_sessions_per_tenant``) joins that tenant's queue on this gateway:

- FIFO within a tenant: only the head of a tenant's queue tries to take a slot, so turns of one
  tenant start in the order they came. Across gateways the store decides which head gets a freed slot.
- Fair across tenants: each tenant has its own queue and its own slots, so a tenant with a long
  queue never delays another tenant's turns.
- Bounded: at most ``max_waiters`` per tenant (more get RESOURCE_EXHAUSTED at once), each for at most
  ``wait_s`` or the client's deadline, whichever is sooner. A refusal carries a retry hint, estimated
  from the queue: (turns ahead / slots) × the tenant's mean turn time on this gateway.

A freed slot admits a waiter on any gateway sharing the store. Every turn's end publishes its
tenant on the store's ``racer:quota-freed:<tenant>`` channel (Redis pub/sub); a gateway with
waiters listens to that channel and wakes the tenant's head at once. Pub/sub is at-most-once (a
message sent while the listener reconnects is lost, and a gateway that dies mid-turn frees its slot
only when its lease expires, with nothing published), so the head also tries again every
``poll_s``: the delay from a freed slot to its admission is a few milliseconds when the message
arrives and at most ``poll_s`` when it does not. Polling alone would cost every waiting head one
store call per interval and up to a whole interval per admission; pub/sub alone could leave a
waiter sleeping beside a free slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from common.errors import Abort, Status

from . import metrics as M

log = logging.getLogger("racer.gateway")

# The initial metadata of a turn that waited for a slot: how long it waited, in ms (clients read it).
QUEUE_WAIT_HEADER = "racer-queue-wait-ms"

FREED = "racer:quota-freed:"  # + tenant: the channel a turn's end is published on


@dataclass(frozen=True)
class Queueing:
    max_waiters: int = 256  # turns of one tenant waiting on one gateway; 0: no queue (refused at once)
    wait_s: float = 120.0  # longest wait for a slot (sooner if the client's deadline is sooner)
    poll_s: float = 1.0  # a waiting head tries again this often even without a notification
    keepalive_s: float = 10.0  # a waiting turn reports that it still waits this often (SSE comments)


@dataclass(frozen=True)
class Queued:
    """The turn waits for a slot: ``ahead`` turns of its tenant are before it on this gateway."""

    session_id: str
    ahead: int
    waited_s: float
    since: float = 0.0  # time.monotonic() when the wait began


class TurnsFull(Abort):
    """A tenant's running turns are at a limit (a quota or this gateway's cap): the turn may wait."""

    def __init__(self, message: str, slots: int):
        super().__init__(Status.RESOURCE_EXHAUSTED, message)
        self.slots = slots  # turns the limit lets run at once


class _Waiter:
    def __init__(self):
        self.wake = asyncio.Event()


class TurnQueue:
    """The waiting turns of every tenant on this gateway, and the listener for freed slots."""

    def __init__(self, cfg: Queueing, store):
        self.cfg = cfg
        self._store = store
        self._queues: dict[str, deque[_Waiter]] = {}
        self._turn_s: dict[str, float] = {}  # tenant -> mean turn duration here (exponential average)
        self._full: dict[str, TurnsFull] = {}  # tenant -> the limit its waiters last met
        self._listener: asyncio.Task | None = None
        self.stopping: str | None = None  # set by the drain: waiters leave with UNAVAILABLE

    def waiting(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    async def enter(
        self, tenant: str, session_id: str, attempt: Callable[[], Awaitable], deadline_s: float | None = None
    ) -> AsyncIterator[Queued | object]:
        """Runs ``attempt`` (which raises ``TurnsFull`` while the tenant's turns are full) until it
        succeeds: yields ``Queued`` while the turn waits (at once, then every ``keepalive_s``) and,
        last, what ``attempt`` returned. ``deadline_s``: seconds the client still waits, if it said."""
        if not self._queues.get(tenant):  # nobody of the tenant waits here: no queue to respect
            try:
                yield await attempt()
                return
            except TurnsFull as e:
                self._full[tenant] = e
        q, w = self._join(tenant)
        bound = self.cfg.wait_s if deadline_s is None else min(self.cfg.wait_s, deadline_s)
        loop_time = asyncio.get_running_loop().time
        start, began = loop_time(), time.monotonic()
        admitted: list = []  # what ``attempt`` returned, once it did
        try:
            yield Queued(session_id, len(q) - 1, 0.0, began)
            next_report = start + self.cfg.keepalive_s
            while not await self._head_tries(tenant, q, w, attempt, admitted):
                now = loop_time()
                if now - start >= bound:
                    M.QUEUE_REFUSALS.labels("timeout").inc()
                    M.QUOTA_REFUSALS.labels("turns").inc()
                    raise self._refusal(tenant, f"it waited {now - start:.1f} s for a slot", q.index(w))
                timeout = min(self.cfg.poll_s, start + bound - now, max(0.0, next_report - now))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(w.wake.wait(), timeout)
                if loop_time() >= next_report:
                    next_report = loop_time() + self.cfg.keepalive_s
                    yield Queued(session_id, q.index(w), loop_time() - start, began)
        finally:
            self._leave(tenant, q, w, loop_time() - start)
        yield admitted[0]

    def _join(self, tenant: str) -> tuple[deque[_Waiter], _Waiter]:
        """A new waiter at the end of ``tenant``'s queue, or the refusal when that queue is full."""
        q = self._queues.setdefault(tenant, deque())
        if len(q) >= self.cfg.max_waiters:
            M.QUEUE_REFUSALS.labels("full").inc()
            M.QUOTA_REFUSALS.labels("turns").inc()
            why = f"its queue on this gateway is full ({len(q)} waiting, queue_max_waiters={self.cfg.max_waiters})"
            refusal = self._refusal(tenant, why, len(q))
            if not q:  # no queue at all (max_waiters=0)
                del self._queues[tenant]
                self._full.pop(tenant, None)
            raise refusal
        w = _Waiter()
        q.append(w)
        M.QUEUE_WAITERS.labels(tenant).set(len(q))
        self._listen()
        return q, w

    async def _head_tries(self, tenant: str, q: deque[_Waiter], w: _Waiter, attempt, admitted: list) -> bool:
        """When ``w`` heads its queue, ``attempt`` once: True (its result appended to ``admitted``) when
        it got a slot. A draining gateway ends the wait with UNAVAILABLE."""
        if self.stopping:
            raise Abort(Status.UNAVAILABLE, self.stopping)
        if q[0] is not w:
            return False
        w.wake.clear()  # before the try: a slot freed during it wakes the next wait
        try:
            admitted.append(await attempt())
        except TurnsFull as e:
            self._full[tenant] = e
            return False
        return True

    def _leave(self, tenant: str, q: deque[_Waiter], w: _Waiter, waited_s: float) -> None:
        """``w`` leaves its queue (admitted, refused or gone): the next head tries at once."""
        M.QUEUE_WAIT_SECONDS.observe(waited_s)
        q.remove(w)
        if q:
            M.QUEUE_WAITERS.labels(tenant).set(len(q))
            q[0].wake.set()  # the next head tries now (another slot may be free)
        else:
            del self._queues[tenant]
            self._full.pop(tenant, None)
            with contextlib.suppress(KeyError):
                M.QUEUE_WAITERS.remove(tenant)  # the label goes with the queue: tenants are unbounded
        if not self._queues and self._listener is not None:
            self._listener.cancel()
            self._listener = None

    def retry_after(self, tenant: str, ahead: int, slots: int) -> float:
        """Seconds until a turn with ``ahead`` turns before it could expect a slot."""
        turn_s = self._turn_s.get(tenant, 1.0)
        return max(1.0, math.ceil((ahead + 1) / max(1, slots)) * turn_s)

    def _refusal(self, tenant: str, why: str, ahead: int) -> Abort:
        full = self._full.get(tenant)
        slots = full.slots if full is not None else 1
        after = self.retry_after(tenant, ahead, slots)
        head = full.message if full is not None else f"tenant {tenant!r}: its turns are full"
        return Abort(
            Status.RESOURCE_EXHAUSTED,
            f"{head}; {why}; retry in about {math.ceil(after)} s",
            retry_after=after,
        )

    async def ended(self, tenant: str, seconds: float) -> None:
        """A turn of ``tenant`` ended here after ``seconds``: the local head tries at once, and the
        other gateways hear of it through the store."""
        prev = self._turn_s.get(tenant)
        self._turn_s[tenant] = seconds if prev is None else 0.8 * prev + 0.2 * seconds
        self._wake(tenant)
        publish = getattr(self._store, "publish", None)
        if publish is not None:
            try:
                await publish(FREED + tenant)
            except Exception as e:  # noqa: BLE001 - waiters elsewhere poll: the notice only makes them sooner
                log.warning("publishing a freed slot failed", extra={"error": repr(e)})

    def stop(self, reason: str) -> None:
        """The gateway drains: every waiter leaves with UNAVAILABLE."""
        self.stopping = reason
        for q in self._queues.values():
            for w in q:
                w.wake.set()

    def _wake(self, tenant: str) -> None:
        q = self._queues.get(tenant)
        if q:
            q[0].wake.set()

    def _listen(self) -> None:
        if self._listener is None and getattr(self._store, "listen", None) is not None:
            self._listener = asyncio.ensure_future(self._listen_forever())

    async def _listen_forever(self) -> None:
        while True:
            try:
                async for channel in self._store.listen(FREED + "*"):
                    self._wake(channel[len(FREED) :])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the store is down or reconnecting: polling covers it
                log.warning("listening for freed slots failed", extra={"error": repr(e)})
            await asyncio.sleep(self.cfg.poll_s)
