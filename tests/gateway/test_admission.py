"""The per-tenant wait queue (gateway/admission.py) over a counter of slots: order, fairness, bounds,
retry hints and wake-ups through the store. Waits are observed through the queue's own state (an
awaited condition), never with a sleep."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import Abort, Status
from common.store import MemoryStore
from gateway.admission import Queued, Queueing, TurnQueue, TurnsFull


class Slots:
    """A tenant's running-turns limit, as the quotas keep it (shared by the queues of two gateways)."""

    def __init__(self, n: int):
        self.n, self.used, self.order = n, 0, []

    def attempt(self, name: str):
        async def go():
            if self.used >= self.n:
                raise TurnsFull(f"turns are full, the quota is turns={self.n}", self.n)
            self.used += 1
            self.order.append(name)
            return name

        return go

    async def free(self, queue: TurnQueue, tenant: str, seconds: float = 2.0) -> None:
        self.used -= 1
        await queue.ended(tenant, seconds)


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0)  # yields to the waiters; no wall-clock bound


async def _take(queue: TurnQueue, tenant: str, name: str, attempt, deadline_s=None, seen=None):
    async for item in queue.enter(tenant, name, attempt, deadline_s):
        if isinstance(item, Queued):
            if seen is not None:
                seen.append(item)
        else:
            return item


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_fifo_within_a_tenant_and_another_tenant_is_not_held_behind():
    async def go():
        q = TurnQueue(Queueing(poll_s=600), MemoryStore())  # no polling: only the wake-ups admit
        a, b = Slots(2), Slots(1)
        assert [await _take(q, "a", f"a{i}", a.attempt(f"a{i}")) for i in range(2)] == ["a0", "a1"]
        waiting = [asyncio.create_task(_take(q, "a", f"a{i}", a.attempt(f"a{i}"))) for i in range(2, 6)]
        await _until(lambda: q.waiting("a") == 4)
        # tenant b is admitted at once while a's queue is full of waiters
        assert await _take(q, "b", "b0", b.attempt("b0")) == "b0"
        assert q.waiting("a") == 4 and a.order == ["a0", "a1"]
        for n in range(2, 6):
            await a.free(q, "a")
            await _until(lambda: a.order[-1] == f"a{n}")
        assert await asyncio.gather(*waiting) == ["a2", "a3", "a4", "a5"]
        assert a.order == [f"a{i}" for i in range(6)] and q.waiting("a") == 0

    _run(go())


def test_a_full_queue_and_a_wait_past_the_bound_are_refused_with_a_retry_hint():
    async def go():
        q = TurnQueue(Queueing(max_waiters=2, wait_s=600, poll_s=600), MemoryStore())
        s = Slots(1)
        await _take(q, "t", "r", s.attempt("r"))
        await s.free(q, "t", seconds=5.0)  # the tenant's turns take 5 s here
        await _take(q, "t", "r", s.attempt("r"))
        seen: list[Queued] = []
        waiting = [asyncio.create_task(_take(q, "t", f"w{i}", s.attempt(f"w{i}"), seen=seen)) for i in range(2)]
        await _until(lambda: q.waiting("t") == 2)
        assert [x.ahead for x in seen] == [0, 1]
        with pytest.raises(Abort) as e:
            await _take(q, "t", "x", s.attempt("x"))
        assert e.value.code is Status.RESOURCE_EXHAUSTED and "turns=1" in e.value.message
        assert "queue on this gateway is full (2 waiting" in e.value.message
        assert e.value.retry_after == 5.0 * 3  # two ahead, one slot, 5 s a turn
        # the client's deadline bounds the wait sooner than the setting
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert q.waiting("t") == 0
        with pytest.raises(Abort) as e:
            await _take(q, "t", "d", s.attempt("d"), deadline_s=0.05)
        assert e.value.code is Status.RESOURCE_EXHAUSTED and "waited" in e.value.message
        assert e.value.retry_after == 5.0
        assert q.waiting("t") == 0

    _run(go())


def test_a_slot_freed_through_another_queue_on_the_same_store_admits_a_waiter():
    async def go():
        store = MemoryStore()
        qa, qb = (TurnQueue(Queueing(poll_s=600), store) for _ in range(2))  # two gateways, one store
        s = Slots(1)
        await _take(qa, "t", "a", s.attempt("a"))
        b = asyncio.create_task(_take(qb, "t", "b", s.attempt("b")))
        await _until(lambda: qb.waiting("t") == 1 and store._listeners)
        s.used -= 1
        await qa.ended("t", 1.0)  # gateway A's turn ended: the notice wakes B's head, no poll needed
        assert await b == "b"
        assert not store._listeners  # the listener goes with the last waiter

    _run(go())


def test_a_drain_ends_the_waits_with_unavailable():
    async def go():
        q = TurnQueue(Queueing(poll_s=600), MemoryStore())
        s = Slots(1)
        await _take(q, "t", "a", s.attempt("a"))
        w = asyncio.create_task(_take(q, "t", "b", s.attempt("b")))
        await _until(lambda: q.waiting("t") == 1)
        q.stop("the gateway is shutting down")
        with pytest.raises(Abort) as e:
            await w
        assert e.value.code is Status.UNAVAILABLE and q.waiting("t") == 0

    _run(go())
