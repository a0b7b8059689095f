"""Batching concurrent sessions' trees, and their prompts, into one forward.

Both batchers hand their forwards to the model thread (``fair.ModelThread``) they are given; they
know nothing of the service that owns them beyond how many of its streams are open (a callable).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from . import metrics as M
from . import native
from .engine import prefill_batch, verify_batch
from .fair import ModelThread

# A lone stream's tree is verified on the event loop (see Batcher.verify) when it has at most
# INLINE_NODES nodes and the last forward took at most INLINE_MS: the loop is held that long at most.
INLINE_NODES = 64
INLINE_MS = 250.0

# The tenant named on tree batches' jobs (no tenant's name: tenants match [A-Za-z0-9_.@-]+): a batch
# holds trees of several tenants, and runs as a round (``fair.py``), in no tenant's flow.
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

    def __init__(
        self, model_thread: ModelThread, streaming: Callable[[], int], max_batch: int = 16, max_wait_ms: float = 20.0
    ):
        """``streaming()``: how many sessions have an open stream now (who could still join a batch)."""
        self.model_thread = model_thread
        self.streaming = streaming
        self.max_batch = max(1, max_batch)
        self.max_wait = max(0.0, max_wait_ms) / 1e3
        self.last_forward = 0.0  # seconds
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.sizes: list[int] = []  # batch sizes, for inspection

    async def verify(self, entry, tokens: list[int], parents: list[int]):
        """``entry``: the session's (its ``session`` and ``tenant``)."""
        session = entry.session
        if self.queue.empty() and self.streaming() <= 1:
            # Nobody to batch with: no queue (its two hops through the event loop would be paid
            # every round). With the model idle and a tree small and quick to verify, the forward
            # runs right here: handing it to the model thread and waking this loop again costs
            # ~0.4 ms a round on a VM (two idle threads' wake-ups), and the loop is held for one
            # short forward at most; a stream that opens meanwhile is batched from its next round.
            here = (
                len(tokens) <= INLINE_NODES and self.last_forward * 1e3 <= INLINE_MS and not self.model_thread.pending
            )
            results, ms = await self._forward([(session, tokens, parents)], here)
            return results[0], ms, 0
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._loop())
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(((session, tokens, parents), fut))
        return await fut

    async def _forward(self, items, here: bool = False):
        """One ``verify_batch`` of ``items``, on this loop when ``here``, else on the model thread as a
        round (``fair.py``: it waits behind a bounded amount of prompt work, and behind no tenant's
        flow), with its bookkeeping: (results, milliseconds)."""
        rows = sum(len(item[1]) for item in items)
        if here:
            with native.lone_stream():  # the other services wait for this forward: every CPU is free
                results, ms = _timed_verify(items)
        else:
            job = self.model_thread.submit(TREES, rows, "verify", _timed_verify, items)
            results, ms = await asyncio.wrap_future(job)
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
                if len(batch) >= self.streaming() or loop.time() >= deadline:
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


@dataclass(eq=False)
class _Prompt:
    """A chunk of one session's prompt waiting for the model thread."""

    tenant: str
    session: object  # engine.VerifierSession
    tokens: list[int]
    choose: bool
    topk_rows: int | None  # top-k of the chunk's last that many positions (None: all)
    prepare: Callable[[], None] | None  # run on the model thread just before the forward
    future: Future = field(default_factory=Future)


class PrefillBatcher:
    """Prompts waiting on the model thread are prefilled together (``prefill_batch``: one pass over
    the weights, each prompt with its own positions, mask and cache).

    Every chunk is still its own job in its tenant's fair turn on the model thread (``fair.py``).
    When one runs, it takes along the chunks of other sessions that wait, round robin across
    tenants, up to ``max_sessions`` prompts and ``max_rows`` tokens in all (the prefill chunk: a
    batch costs the model no more than one chunk did, so a waiting round is held up by at most one
    chunk past the model thread's lead). A chunk taken along makes its own job a no-op when that
    job's turn comes, which charges its tenant for the work then; the rounds' wait is charged the
    batch's tokens at once (``ModelThread.worked``). ``max_sessions=1``: one prompt per forward.
    """

    def __init__(self, model_thread: ModelThread, max_sessions: int = 16, max_rows: int = 512):
        self.model_thread = model_thread
        self.max_sessions = max(1, max_sessions)
        self.max_rows = max(1, max_rows)
        self._lock = threading.Lock()
        self._waiting: dict[str, deque[_Prompt]] = {}  # tenant -> its waiting chunks, in order
        self.sizes: list[int] = []  # prompts per forward, for inspection

    async def prefill(self, tenant: str, session, tokens: list[int], choose: bool, prepare=None, topk_rows=None):
        """``session.prefill(tokens, choose, topk_rows)``, maybe with other sessions' prompts in the
        forward (``prepare`` first, on the model thread)."""
        item = _Prompt(tenant, session, tokens, choose, topk_rows, prepare)
        with self._lock:
            self._waiting.setdefault(tenant, deque()).append(item)
        job = self.model_thread.submit(tenant, len(tokens), "prefill", self._run, item)
        job.add_done_callback(lambda job: self._settle(item, job))
        try:
            return await asyncio.wrap_future(item.future)
        except asyncio.CancelledError:
            with self._lock:
                self._drop(item)  # not taken yet: it never runs (taken: it runs, like a started job)
            job.cancel()
            raise

    def _drop(self, item: _Prompt) -> bool:
        q = self._waiting.get(item.tenant)
        if q is None or item not in q:
            return False
        q.remove(item)
        if not q:
            del self._waiting[item.tenant]
        return True

    def _take(self, own: _Prompt) -> list[_Prompt]:
        """``own`` and the waiting chunks that join it (under the lock); empty if ``own`` was taken."""
        if not self._drop(own) or not own.future.set_running_or_notify_cancel():
            return []
        batch, rows = [own], len(own.tokens)
        tenants = list(self._waiting)
        if own.tenant in tenants:  # the others' turn first, then own's tenant again
            i = tenants.index(own.tenant)
            tenants = tenants[i + 1 :] + tenants[: i + 1]
        while len(batch) < self.max_sessions and tenants:
            for tenant in list(tenants):
                q = self._waiting.get(tenant)
                if not q or len(batch) >= self.max_sessions or rows + len(q[0].tokens) > self.max_rows:
                    tenants.remove(tenant)  # this tenant's next chunk does not fit: it waits its turn
                    continue
                item = q[0]
                self._drop(item)
                if item.future.set_running_or_notify_cancel():
                    batch.append(item)
                    rows += len(item.tokens)
        return batch

    def _run(self, own: _Prompt) -> list[tuple[_Prompt, object]]:
        """On the model thread: ``own``'s job. Returns each chunk it prefilled with its result (or
        error), which ``_settle`` hands over once the job is done: a waiter that wakes then finds
        the model thread no longer busy with it, as after any job."""
        with self._lock:
            batch = self._take(own)
        # what the rounds waiting meanwhile are held up by: the whole batch, or nothing (taken along)
        self.model_thread.worked(sum(len(item.tokens) for item in batch))
        out: list[tuple[_Prompt, object]] = []
        ready = []
        for item in batch:
            try:
                if item.prepare is not None:
                    item.prepare()
                ready.append(item)
            except BaseException as e:  # noqa: BLE001 - its waiter gets it
                out.append((item, e))
        if not ready:
            return out
        try:
            results = prefill_batch([(item.session, item.tokens, item.choose, item.topk_rows) for item in ready])
        except BaseException as e:  # noqa: BLE001 - every waiter of the forward gets it
            return out + [(item, e) for item in ready]
        self.sizes.append(len(ready))
        M.PREFILL_BATCH_SIZE.observe(len(ready))
        return out + list(zip(ready, results))

    def _settle(self, own: _Prompt, job: Future) -> None:
        if job.cancelled():  # never ran (a cancelled stream, a closed model thread): nor does ``own``
            with self._lock:
                self._drop(own)
            own.future.cancel()  # (a chunk another job took along is running: that job settles it)
            return
        if job.exception() is not None:
            if not own.future.done():
                own.future.set_exception(job.exception())
            return
        for item, res in job.result():
            if isinstance(res, BaseException):
                item.future.set_exception(res)
            else:
                item.future.set_result(res)
