"""The verifier's core: the target model on one worker thread and one KV cache per session.

Model work runs on one worker thread (the forward releases the GIL), so health checks and other
streams stay responsive while a prefill, a batch or a big tree is computed; a lone stream's small
trees are verified on the event loop itself when the last forward was short (INLINE_MS), which
holds the loop for one short forward. Caches outlive streams: a session's next turn
prefills only its new tokens. They are bounded by count and by total tokens; the least recently
used idle cache goes first, and an evicted session is simply re-prefilled when it comes back.
No grpc: ``verifier/service.py`` converts its messages.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from common.errors import Abort, Status
from common.params import SamplingParams
from common.sessions import Entry as _Entry
from common.sessions import Holder, SessionTable

from . import metrics as M
from .batcher import Batcher
from .engine import VerifierSession

MAX_TREE = 4096


@dataclass
class Entry(_Entry):
    session: VerifierSession = None  # type: ignore[assignment] - always given
    tokens: list[int] = field(default_factory=list)  # what the KV cache holds, in order


@dataclass(frozen=True)
class Open:
    tenant: str
    session_id: str
    history: list[int]
    sampling: tuple = (0.0, 1.0, 0, None)  # SamplingParams' fields: temperature, top_p, top_k, seed


@dataclass(frozen=True)
class Prefilled:
    next_token: int
    topk: list[int]  # [len(prefilled) * topk] flattened
    reused_tokens: int
    cache_tokens: int
    elapsed_ms: float


@dataclass(frozen=True)
class Verified:
    next_token: int  # the bonus token
    accepted: list[int]  # accepted node indices, root first
    topk: list[int]  # [nodes * topk] flattened
    cache_tokens: int
    elapsed_ms: float
    batch_rows: int  # other sessions' rows in the same forward


@dataclass(frozen=True)
class SessionStats:
    tenant: str
    session_id: str
    cache_tokens: int
    streaming: bool
    idle_seconds: float


class Verifier(Holder):
    def __init__(
        self,
        model,
        topk: int = 8,
        backend: str = "auto",
        max_sessions: int = 64,
        max_cache_tokens: int = 262_144,
        ttl: float = 1800.0,
        cost: dict[int, float] | None = None,
        max_batch: int = 16,
        max_wait_ms: float = 20.0,
    ):
        self.model = model
        self.topk = topk
        self.backend = backend
        self.vocab_size = model.config.vocab_size
        self.max_sessions = max_sessions
        self.max_cache_tokens = max_cache_tokens
        M.CACHE_TOKENS_LIMIT.set(max_cache_tokens)
        self.sessions: SessionTable[Entry] = SessionTable(ttl)
        # ms per verification by tree size: measured at start-up, kept current by unbatched verifications
        self.cost: dict[int, float] = dict(cost or {})
        self.batcher = Batcher(self, max_batch, max_wait_ms)
        # OpenMP thread settings are per thread: the worker takes the creating thread's count.
        threads = torch.get_num_threads()
        self.busy = 0  # calls handed to the model thread and not yet over
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="verifier-model", initializer=torch.set_num_threads, initargs=(threads,)
        )

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

    def claim(self, op: Open) -> Entry:
        """The session's entry, held by the calling stream, with room made for its history."""
        if not op.session_id:
            raise Abort(Status.INVALID_ARGUMENT, "open.session_id: required")
        if not op.tenant:
            raise Abort(Status.INVALID_ARGUMENT, "open.tenant: required")
        if not op.history:
            raise Abort(Status.INVALID_ARGUMENT, "open.history: empty")
        bad = next((t for t in op.history if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise Abort(
                Status.INVALID_ARGUMENT, f"open.history: token id {bad} outside the vocabulary [0, {self.vocab_size})"
            )
        if len(op.history) > self.max_cache_tokens:
            raise Abort(
                Status.RESOURCE_EXHAUSTED,
                f"open.history: {len(op.history)} tokens, this verifier holds at most {self.max_cache_tokens}",
            )
        try:
            sampling = SamplingParams(*op.sampling)
        except ValueError as e:
            raise Abort(Status.INVALID_ARGUMENT, f"open.sampling: {e}") from None
        key = (op.tenant, op.session_id)
        entry = self.sessions.get(key)
        if entry is not None and entry.streaming:
            raise Abort(Status.ABORTED, f"session {op.session_id}: another stream is open on it")
        self._make_room(len(op.history), keep=key)
        if entry is None:
            entry = self.sessions.put(
                Entry(op.tenant, op.session_id, session=VerifierSession(self.model, self.topk, self.backend, sampling))
            )
        entry.session.set_sampling(sampling)
        self.sessions.claim(entry)
        M.VERIFIER_SESSIONS.set(len(self.sessions))
        return entry

    def _make_room(self, tokens: int, keep: tuple[str, str]) -> None:
        """Evicts idle caches, least recently used first, until a session of ``tokens`` fits."""

        def over() -> bool:
            held = sum(len(e.tokens) for e in self.sessions if e.key != keep)
            count = len(self.sessions) + (keep not in self.sessions)
            return count > self.max_sessions or held + tokens > self.max_cache_tokens

        while over():
            victim = self.sessions.idle_lru(keep)
            if victim is None:
                raise Abort(Status.RESOURCE_EXHAUSTED, "verifier full: every KV cache is in use by a stream")
            self.sessions.pop(victim.key)
            M.EVICTIONS.labels("capacity").inc()

    async def open(self, entry: Entry, history: list[int]) -> Prefilled:
        """Keeps the longest prefix of ``history`` the cache holds and prefills the rest."""
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
        M.PREFILL_SECONDS.observe(elapsed / 1e3)
        M.REUSED_TOKENS.inc(reuse)
        self._gauge()
        return Prefilled(res.next_token, [t for row in res.topk for t in row], reuse, len(entry.tokens), elapsed)

    async def verify(self, entry: Entry, tokens: list[int], parents: list[int]) -> Verified:
        """One tree of the session's, alone or batched with other sessions' trees."""
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
        entry.touch()
        elapsed = (time.perf_counter() - t0) * 1e3
        M.VERIFY_SECONDS.observe(elapsed / 1e3)
        return Verified(
            res.bonus, res.accepted, [t for row in res.topk for t in row], len(entry.tokens), elapsed, others
        )

    def streaming(self) -> int:
        return self.sessions.streaming()

    def release(self, entry: Entry) -> None:
        self.sessions.release(entry)

    def _forget(self, entry: Entry) -> None:
        self.sessions.pop(entry.key)
        self._gauge()

    def _gauge(self) -> None:
        M.VERIFIER_SESSIONS.set(len(self.sessions))
        M.CACHE_TOKENS.set(sum(len(e.tokens) for e in self.sessions))

    async def expire(self) -> int:
        gone = self.sessions.expire()
        M.EVICTIONS.labels("idle").inc(len(gone))
        self._gauge()
        return len(gone)

    def drop(self, tenant: str, session_id: str) -> bool:
        entry = self.sessions.pop((tenant, session_id))
        self._gauge()
        return entry is not None

    def stats(self) -> list[SessionStats]:
        now = time.monotonic()
        return [
            SessionStats(e.tenant, e.session_id, len(e.tokens), e.streaming, now - e.last_used) for e in self.sessions
        ]

    @property
    def cache_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.sessions)

    def close(self) -> None:
        """After the server stopped: ends the batcher (from any thread) and the model thread."""
        task = self.batcher.task
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)
        self._pool.shutdown(wait=True, cancel_futures=True)
