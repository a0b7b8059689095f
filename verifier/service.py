"""The verifier service: the target model and one KV cache per session, behind a gRPC stream.

Model work runs on one worker thread (the forward releases the GIL), so health checks and other
streams stay responsive while a prefill, a batch or a big tree is computed; a lone stream's small
trees are verified on the event loop itself when the last forward was short (INLINE_MS), which
holds the loop for one short forward. Caches outlive streams: a session's next turn
prefills only its new tokens. They are bounded by count and by total tokens; the least recently
used idle cache goes first, and an evicted session is simply re-prefilled when it comes back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import metrics as M
from common.errors import Abort, Status
from common.v1 import common_pb2 as cpb
from common.v1 import verifier_pb2 as pb
from common.v1 import verifier_pb2_grpc as pb_grpc

from .engine import VerifierSession, verify_batch
from common.params import SamplingParams

log = logging.getLogger("racer.verifier")

MAX_TREE = 4096
# A lone stream's tree is verified on the event loop (see Batcher.verify) when it has at most
# INLINE_NODES nodes and the last forward took at most INLINE_MS: the loop is held that long at most.
INLINE_NODES = 64
INLINE_MS = 250.0


def _timed_verify(items):
    """``verify_batch`` and its milliseconds."""
    t = time.perf_counter()
    out = verify_batch(items)
    return out, (time.perf_counter() - t) * 1e3


@dataclass
class Entry:
    tenant: str
    session_id: str
    session: VerifierSession
    tokens: list[int] = field(default_factory=list)  # what the KV cache holds, in order
    last_used: float = field(default_factory=time.monotonic)
    streaming: bool = False


class Batcher:
    """Gathers concurrent sessions' trees into one forward (``verify_batch``).

    A batch closes when it holds ``max_batch`` trees, or as soon as every session with an open
    stream has a tree in it (nobody else can join, so waiting would only add latency), or when it
    has waited a quarter of the last forward's time since its first tree, at most ``max_wait_ms``.
    A tree that misses a batch waits a whole forward for the next one, and a session's tree comes
    back a drafter round trip after its last result: with a fixed short wait, concurrent sessions
    split into groups that take turns on the model, each round costing every session two forwards.
    """

    def __init__(self, service: "VerifierService", max_batch: int = 16, max_wait_ms: float = 20.0):
        self.service = service
        self.max_batch = max(1, max_batch)
        self.max_wait = max(0.0, max_wait_ms) / 1e3
        self.last_forward = 0.0  # seconds
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.sizes: list[int] = []  # batch sizes, for inspection

    async def verify(self, session, tokens: list[int], parents: list[int]):
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
        """One ``verify_batch`` of ``items``, on this loop when ``here``, else on the model thread,
        with its bookkeeping: (results, milliseconds)."""
        results, ms = _timed_verify(items) if here else await self.service._run(_timed_verify, items)
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


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, model, topk: int = 8, backend: str = "auto", max_sessions: int = 64,
                 max_cache_tokens: int = 262_144, ttl: float = 1800.0, cost: dict[int, float] | None = None,
                 max_batch: int = 16, max_wait_ms: float = 20.0):
        self.model = model
        self.topk = topk
        self.backend = backend
        self.vocab_size = model.config.vocab_size
        self.max_sessions = max_sessions
        self.max_cache_tokens = max_cache_tokens
        self.ttl = ttl
        self.sessions: dict[tuple[str, str], Entry] = {}
        # ms per verification by tree size: measured at start-up, kept current by unbatched verifications
        self.cost: dict[int, float] = dict(cost or {})
        self.batcher = Batcher(self, max_batch, max_wait_ms)
        # OpenMP thread settings are per thread: the worker takes the creating thread's count.
        threads = torch.get_num_threads()
        self.busy = 0  # calls handed to the model thread and not yet over
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="verifier-model", initializer=torch.set_num_threads,
                                        initargs=(threads,))

    async def _run(self, fn, *args):
        """``fn(*args)`` on the model thread; ``busy`` counts it until it is over, even when the
        caller stops waiting for it (a cancelled stream)."""
        loop = asyncio.get_running_loop()
        self.busy += 1
        job = self._pool.submit(fn, *args)
        job.add_done_callback(lambda _: self._done_one(loop))
        return await asyncio.wrap_future(job)

    def _done_one(self, loop) -> None:  # on the model thread
        def dec():
            self.busy -= 1

        try:
            loop.call_soon_threadsafe(dec)
        except RuntimeError:  # the loop has closed: nobody is left to count for
            pass

    # -- the stream ---------------------------------------------------------------------------
    async def Session(self, request_iterator, context):
        entry: Entry | None = None
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "open":
                    if entry is not None:
                        raise Abort(Status.FAILED_PRECONDITION, "open: this stream already has a session")
                    entry = self._claim(req.open)
                    yield await self._open(entry, req.open)
                elif kind == "tree":
                    if entry is None:
                        raise Abort(Status.FAILED_PRECONDITION, "tree: open the session first")
                    yield await self._verify(entry, req.tree)
                else:
                    raise Abort(Status.INVALID_ARGUMENT, "request: set one of open, tree")
        finally:
            if entry is not None:
                entry.streaming = False
                entry.last_used = time.monotonic()

    def _claim(self, op: pb.VerifierOpen) -> Entry:
        if not op.session_id:
            raise Abort(Status.INVALID_ARGUMENT, "open.session_id: required")
        if not op.tenant:
            raise Abort(Status.INVALID_ARGUMENT, "open.tenant: required")
        if not op.history:
            raise Abort(Status.INVALID_ARGUMENT, "open.history: empty")
        bad = next((t for t in op.history if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise Abort(Status.INVALID_ARGUMENT, f"open.history: token id {bad} outside the vocabulary [0, {self.vocab_size})")
        if len(op.history) > self.max_cache_tokens:
            raise Abort(Status.RESOURCE_EXHAUSTED,
                         f"open.history: {len(op.history)} tokens, this verifier holds at most {self.max_cache_tokens}")
        try:
            sampling = SamplingParams(op.sampling.temperature, op.sampling.top_p or 1.0, op.sampling.top_k,
                                      op.sampling.seed if op.sampling.HasField("seed") else None)
        except ValueError as e:
            raise Abort(Status.INVALID_ARGUMENT, f"open.sampling: {e}") from None
        key = (op.tenant, op.session_id)
        entry = self.sessions.get(key)
        if entry is not None and entry.streaming:
            raise Abort(Status.ABORTED, f"session {op.session_id}: another stream is open on it")
        self._make_room(len(op.history), keep=key)
        if entry is None:
            entry = Entry(op.tenant, op.session_id, VerifierSession(self.model, self.topk, self.backend, sampling))
            self.sessions[key] = entry
        entry.session.set_sampling(sampling)
        entry.streaming = True
        entry.last_used = time.monotonic()
        M.VERIFIER_SESSIONS.set(len(self.sessions))
        return entry

    def _make_room(self, tokens: int, keep: tuple[str, str]) -> None:
        """Evicts idle caches, least recently used first, until a session of ``tokens`` fits."""
        def over() -> bool:
            held = sum(len(e.tokens) for k, e in self.sessions.items() if k != keep)
            count = len(self.sessions) + (keep not in self.sessions)
            return count > self.max_sessions or held + tokens > self.max_cache_tokens

        while over():
            idle = [e for k, e in self.sessions.items() if not e.streaming and k != keep]
            if not idle:
                raise Abort(Status.RESOURCE_EXHAUSTED, "verifier full: every KV cache is in use by a stream")
            victim = min(idle, key=lambda e: e.last_used)
            del self.sessions[(victim.tenant, victim.session_id)]
            M.EVICTIONS.labels("capacity").inc()

    async def _open(self, entry: Entry, op: pb.VerifierOpen) -> pb.VerifyResponse:
        history = list(op.history)
        have = entry.tokens
        common = 0
        for a, b in zip(have, history):
            if a != b:
                break
            common += 1
        reuse = min(common, len(history) - 1)  # at least one token is fed: its logits pick the next
        t0 = time.perf_counter()
        # Whatever happens to this call, the cache's first ``reuse`` rows stay valid: the work only
        # truncates to them and appends. A cancelled stream (the worker may still run the work)
        # thus keeps a cache the next open can reuse.
        entry.tokens = have[:reuse]

        def work():
            entry.session.truncate(reuse)
            return entry.session.prefill(history[reuse:])

        try:
            res = await self._run(work)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._forget(entry)  # a forward that failed halfway leaves the cache unknown
            raise
        entry.tokens = history
        elapsed = (time.perf_counter() - t0) * 1e3
        M.PREFILL_MS.observe(elapsed)
        M.REUSED_TOKENS.inc(reuse)
        self._gauge()
        return pb.VerifyResponse(
            next_token=res.next_token, topk=[t for row in res.topk for t in row], topk_width=self.topk,
            reused_tokens=reuse, cache_tokens=len(entry.tokens), elapsed_ms=elapsed,
            cost=self._cost_curve(),
        )

    async def _verify(self, entry: Entry, tree: pb.VerifyTree) -> pb.VerifyResponse:
        tokens, parents = list(tree.tokens), list(tree.parents)
        if len(tokens) > MAX_TREE:
            raise Abort(Status.INVALID_ARGUMENT, f"tree.tokens: {len(tokens)} nodes, at most {MAX_TREE}")
        t0 = time.perf_counter()
        try:
            res, forward_ms, others = await self.batcher.verify(entry.session, tokens, parents)
        except asyncio.CancelledError:
            raise  # the forward only appends after ``entry.tokens`` (same worker thread): they stay a valid prefix
        except BaseException:
            self._forget(entry)  # the forward may or may not have run: the cache is unknown
            raise
        if isinstance(res, ValueError):  # validated before the forward: the cache is untouched
            raise Abort(Status.INVALID_ARGUMENT, f"tree: {res}")
        entry.tokens.extend(tokens[i] for i in res.accepted)
        n = len(tokens)
        if n in self.cost and others == 0:  # an exponential average follows drift (load, context length)
            self.cost[n] += 0.05 * (forward_ms - self.cost[n])
        entry.last_used = time.monotonic()
        elapsed = (time.perf_counter() - t0) * 1e3
        M.VERIFY_MS.observe(elapsed)
        return pb.VerifyResponse(
            next_token=res.bonus, accepted=res.accepted, topk=[t for row in res.topk for t in row],
            topk_width=self.topk, cache_tokens=len(entry.tokens), elapsed_ms=elapsed, batch_rows=others,
        )

    def _cost_curve(self) -> cpb.CostCurve:
        return cpb.CostCurve(sizes=list(self.cost), ms=list(self.cost.values()))

    def streaming(self) -> int:
        return sum(1 for e in self.sessions.values() if e.streaming)

    def _forget(self, entry: Entry) -> None:
        self.sessions.pop((entry.tenant, entry.session_id), None)
        self._gauge()

    def _gauge(self) -> None:
        M.VERIFIER_SESSIONS.set(len(self.sessions))
        M.CACHE_TOKENS.set(sum(len(e.tokens) for e in self.sessions.values()))

    async def expire(self) -> int:
        now = time.monotonic()
        gone = [k for k, e in self.sessions.items() if not e.streaming and now - e.last_used > self.ttl]
        for k in gone:
            del self.sessions[k]
            M.EVICTIONS.labels("idle").inc()
        self._gauge()
        return len(gone)

    # -- unary calls --------------------------------------------------------------------------
    async def Drop(self, request, context):
        entry = self.sessions.pop((request.tenant, request.session_id), None)
        self._gauge()
        return pb.VerifierDropResponse(existed=entry is not None)

    async def Stats(self, request, context):
        now = time.monotonic()
        return pb.VerifierStatsResponse(
            sessions=[
                pb.VerifierSessionStats(session_id=e.session_id, tenant=e.tenant, cache_tokens=len(e.tokens),
                                        streaming=e.streaming, idle_seconds=now - e.last_used)
                for e in self.sessions.values()
            ],
            cache_tokens=sum(len(e.tokens) for e in self.sessions.values()),
            cost=self._cost_curve(),
        )

    def close(self) -> None:
        """After the server stopped: ends the batcher (from any thread) and the model thread."""
        task = self.batcher.task
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)
        self._pool.shutdown(wait=True, cancel_futures=True)
