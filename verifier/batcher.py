"""Batching concurrent sessions' trees into one forward."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from . import metrics as M
from .engine import verify_batch

if TYPE_CHECKING:
    from .sessions import Verifier

# A lone stream's tree is verified on the event loop (see Batcher.verify) when it has at most
# INLINE_NODES nodes and the last forward took at most INLINE_MS: the loop is held that long at most.
INLINE_NODES = 64
INLINE_MS = 250.0

# The model thread's flow of tree batches (no tenant's name: tenants match [A-Za-z0-9_.@-]+).
TREES = " trees"


def _timed_verify(items):
    """``verify_batch`` and its milliseconds."""
    t = time.perf_counter()
    out = verify_batch(items)
    return out, (time.perf_counter() - t) * 1e3


class Batcher:
    """Gathers concurrent sessions' trees into one forward (``verify_batch``).

    A batch closes when it holds ``max_batch`` trees, or as soon as every session with an open
    stream has a tree in it (nobody else can join, so waiting would only add latency), or when it
    has waited a quarter of the last forward's time since its first tree, at most ``max_wait_ms``.
    A tree that misses a batch waits a whole forward for the next one, and a session's tree comes
    back a drafter round trip after its last result: with a fixed short wait, concurrent sessions
    split into groups that take turns on the model, each round costing every session two forwards.
    """

    def __init__(self, service: Verifier, max_batch: int = 16, max_wait_ms: float = 20.0):
        self.service = service
        self.max_batch = max(1, max_batch)
        self.max_wait = max(0.0, max_wait_ms) / 1e3
        self.last_forward = 0.0  # seconds
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.sizes: list[int] = []  # batch sizes, for inspection

    async def verify(self, entry, tokens: list[int], parents: list[int]):
        """``entry``: the session's (its ``session`` and ``tenant``)."""
        session = entry.session
        if self.queue.empty() and self.service.streaming() <= 1:
            # Nobody to batch with: no queue (its two hops through the event loop would be paid
            # every round). With the model idle and a tree small and quick to verify, the forward
            # runs right here: handing it to the model thread and waking this loop again costs
            # ~0.4 ms a round on a VM (two idle threads' wake-ups), and the loop is held for one
            # short forward at most; a stream that opens meanwhile is batched from its next round.
            here = len(tokens) <= INLINE_NODES and self.last_forward * 1e3 <= INLINE_MS and not self.service.busy
            results, ms = await self._forward([(session, tokens, parents)], here)
            return results[0], ms, 0
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._loop())
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(((session, tokens, parents), fut))
        return await fut

    async def _forward(self, items, here: bool = False):
        """One ``verify_batch`` of ``items``, on this loop when ``here``, else on the model thread in
        the fair turn of the tree batches' own flow (``TREES``, charged by rows: a batch holds trees
        of several tenants, and in no tenant's flow it waits behind no tenant's queued prefills),
        with its bookkeeping: (results, milliseconds)."""
        rows = sum(len(item[1]) for item in items)
        if here:
            results, ms = _timed_verify(items)
        else:
            results, ms = await self.service._run(_timed_verify, items, tenant=TREES, cost=rows, kind="verify")
        self.sizes.append(len(items))
        M.BATCH_SIZE.observe(len(items))
        self.last_forward = ms / 1e3
        return results, ms

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + min(self.max_wait, 0.25 * self.last_forward)
            while len(batch) < self.max_batch:
                if not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                    continue
                if len(batch) >= self.service.streaming() or loop.time() >= deadline:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
            batch = [(item, fut) for item, fut in batch if not fut.cancelled()]
            if not batch:
                continue
            try:
                results, ms = await self._forward([item for item, _ in batch])
            except Exception as e:  # noqa: BLE001 - every waiter learns of it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            rows = sum(len(item[1]) for item, _ in batch)
            for (item, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result((res, ms, rows - len(item[1])))
