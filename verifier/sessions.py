"""The verifier's core: the target model on one worker thread and one KV cache per session.

Model work runs on one worker thread (the forward releases the GIL), so health checks and other
streams stay responsive while a prefill, a batch or a big tree is computed; a lone stream's small
trees are verified on the event loop itself when the last forward was short (INLINE_MS), which
holds the loop for one short forward. Caches outlive streams: a session's next turn
prefills only its new tokens. They are bounded by count and by KV memory in bytes
(``kv_memory.py``): an open reserves its history, the turn's ``reserve_tokens`` and ``headroom``
rows (a tree) before any of it is allocated, a cache grows only by a further reservation, and an idle cache gives its
spare rows back. The least recently used idle cache is evicted for room (an evicted session is
simply re-prefilled when it comes back); what still does not fit waits in a bounded queue.
The model thread (``fair.py``) serves tenants' prompts in fair turns, ahead of the running streams'
rounds for at most ``prefill_lead`` tokens; a long prefill runs in chunks of ``prefill_chunk`` tokens,
so other tenants' prefills and rounds pass between them, and prompts that wait together are
prefilled in one forward of at most that many tokens (``PrefillBatcher``).
No grpc: ``verifier/service.py`` converts its messages.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import torch

from common import settings
from common.costs import ContextSlope, follow
from common.errors import Abort, Status
from common.params import SamplingParams
from common.sessions import Holder, SessionTable

from . import metrics as M
from . import native
from .batcher import Batcher, PrefillBatcher
from .constraints import LogProbs
from .engine import VerifierSession
from .entry import Entry
from .fair import ModelThread
from .gguf_blocks import cache_dtype
from .kv_memory import KVMemory, default_kv_bytes, kv_bytes_per_token
from .prefix_cache import BLOCK_TOKENS, Match, PrefixCache
from .prefix_transfer import PREFIX_KEY, PrefixTransfer, RowsMoved

log = logging.getLogger("racer.verifier")

MAX_TREE = 4096


@dataclass(frozen=True)
class Open:
    tenant: str
    session_id: str
    history: list[int]
    sampling: tuple = (0.0, 1.0, 0, None)  # SamplingParams' fields: temperature, top_p, top_k, seed
    timeout: float | None = None  # seconds the client still waits (its deadline): the longest wait for room
    reserve_tokens: int = 0  # new tokens the turn may add: reserved at open with the history and the headroom
    # The prefix cache's scope, chosen by the gateway (a sharing group of tenants); empty: the tenant.
    scope: str = ""


@dataclass(frozen=True)
class Prefilled:
    next_token: int
    topk: list[int]  # [rows * topk] flattened: the prefilled tokens' last rows (``prompt_topk``)
    reused_tokens: int
    cache_tokens: int
    elapsed_ms: float
    logprobs: LogProbs | None = None  # of next_token, when the open asked for them
    prefix_tokens: int = 0  # history tokens whose rows came from the prefix cache (not prefilled)
    fetched_tokens: int = 0  # of those, tokens whose rows this open fetched from another verifier


@dataclass(frozen=True)
class Verified:
    next_token: int  # the bonus token
    accepted: list[int]  # accepted node indices, root first
    topk: list[int]  # [nodes * topk] flattened
    cache_tokens: int
    elapsed_ms: float
    batch_rows: int  # other sessions' rows in the same forward
    logprobs: LogProbs | None = None  # of the accepted nodes' successors and the bonus, when asked for


@dataclass(frozen=True)
class SessionStats:
    tenant: str
    session_id: str
    cache_tokens: int
    streaming: bool
    idle_seconds: float


class Verifier(PrefixTransfer, Holder):
    """The verifier's core. Every setting but the model is a keyword (its flag in
    ``common/settings.py``): ``topk`` ids per position sent back, ``backend`` (auto, llama, hf),
    ``max_sessions`` caches held, ``max_cache_tokens`` (KV memory without ``kv_memory_bytes`` or a
    memory limit), ``ttl`` of an idle cache in seconds, ``cost`` (ms by tree size) and its ``slope``
    against the context, ``max_batch`` trees and ``max_wait_ms`` per batch, ``headroom`` rows,
    ``prefill_chunk`` tokens per prefill job, ``max_waiting`` opens for at most ``wait_seconds`` in
    KV memory's queue, ``stall_seconds`` before the model thread counts as stalled,
    ``prefill_batch`` prompts per forward, ``prompt_topk`` the prompt's last positions whose top-k
    an open sends back (None: every position), ``prefix_cache`` on or off and its ``prefix_block``
    (tokens per block, ``prefix_cache.py``); ``prefix_fetch`` (auto: by the measured rule, always,
    off) the blocks another verifier holds, within ``prefix_fetch_seconds`` and
    ``prefix_fetch_bytes`` a transfer (``prefix_fetch.py``; ``fetcher``, the transport, is the
    service's); a session moving off a draining verifier fetches its own rows the same way (a
    hand-over), and a joining verifier fills at most ``prefix_warm_share`` of its KV memory with a
    holder's hottest blocks (``warm``)."""

    def __init__(
        self,
        model,
        *,
        topk: int = settings.default("verifier", "--topk"),
        backend: str = "auto",
        max_sessions: int = 64,
        max_cache_tokens: int = 262_144,
        ttl: float = 1800.0,
        cost: dict[int, float] | None = None,
        slope: ContextSlope | None = None,
        max_batch: int = 16,
        max_wait_ms: float = 20.0,
        kv_memory_bytes: int = 0,
        headroom: int = 320,
        prefill_chunk: int = 512,
        max_waiting: int = 64,
        wait_seconds: float = 20.0,
        stall_seconds: float = 60.0,
        prefill_batch: int = 16,
        prefill_lead: int = 2048,
        prompt_topk: int | None = None,
        prefix_cache: bool = True,
        prefix_block: int = BLOCK_TOKENS,
        prefix_fetch: str = "auto",
        prefix_fetch_seconds: float = 10.0,
        prefix_fetch_bytes: int = 1 << 30,
        prefix_warm_share: float = 0.25,
    ):
        self.model = model
        self.topk = topk
        self.backend = backend
        self.vocab_size = model.config.vocab_size
        self.max_sessions = max_sessions
        self.headroom = headroom  # rows reserved past the history and the turn's new tokens: a tree
        self.prefill_chunk = max(1, prefill_chunk)
        self.prompt_topk = prompt_topk
        self.stall_seconds = stall_seconds
        self.sessions: SessionTable[Entry] = SessionTable(ttl)
        per_token = kv_bytes_per_token(model.config, cache_dtype(model).itemsize)
        total = kv_memory_bytes or default_kv_bytes(model, per_token, max_cache_tokens)
        self.kv_memory = KVMemory(total, per_token, self._evict, max_waiting, wait_seconds)
        self.prefix = PrefixCache(per_token * prefix_block, prefix_block) if prefix_cache else None
        self.epoch = secrets.randbits(64)  # reported to gateways: a restarted verifier's cache is known cold
        # ms per verification by tree size: measured at start-up, kept current by unbatched verifications
        self.cost: dict[int, float] = dict(cost or {})
        self.slope = slope  # what each token of a session's context adds to ``cost`` (None: not measured)
        # OpenMP thread settings are per thread: the worker takes the creating thread's count.
        self.model_thread = ModelThread(self.prefill_chunk, torch.get_num_threads(), lead=prefill_lead)
        self.batcher = Batcher(self.model_thread, self.streaming, max_batch, max_wait_ms)
        self.prefills = PrefillBatcher(self.model_thread, prefill_batch, self.prefill_chunk)
        # Loaded (and checked) now if no plan has loaded it yet: what this verifier reports, and its
        # prefix fingerprint, never depend on whether a forward has run before it started.
        native.library()
        setup = self.setup()
        for check in setup.kernel_checks:
            M.KERNEL_REFUSED.labels(check.kernel).set(0 if check.ok else 1)
        M.KERNEL_CHECK_SECONDS.set(setup.kernel_check_seconds)
        self._init_transfers(
            setup, prefix_block, prefix_fetch, prefix_fetch_seconds, prefix_fetch_bytes, prefix_warm_share
        )

    def setup(self):
        """What this verifier computes with (``verifier/setup.py``)."""
        from . import setup

        return setup.of(self.model, self.backend)

    @property
    def busy(self) -> int:
        """Jobs handed to the model thread and not yet over (queued or running)."""
        return self.model_thread.pending

    async def _run(self, fn, *args, tenant: str = "", cost: int = 1, kind: str = "verify"):
        """``fn(*args)`` on the model thread, in ``tenant``'s fair turn (``cost``: tokens or rows).
        A caller that stops waiting (a cancelled stream) cancels it if it has not started."""
        return await asyncio.wrap_future(self.model_thread.submit(tenant, cost, kind, fn, *args))

    def stalled(self) -> bool:
        """The model thread has had work for ``stall_seconds`` and finished none of it."""
        return self.model_thread.stalled(self.stall_seconds)

    def claim(self, op: Open) -> Entry:
        """The session's entry, held by the calling stream (``open`` makes room for its history)."""
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
        if op.reserve_tokens < 0:
            raise Abort(Status.INVALID_ARGUMENT, f"open.reserve_tokens: {op.reserve_tokens} is negative")
        need = self.kv_memory.bytes_for(len(op.history) + op.reserve_tokens + self.headroom)
        if need > self.kv_memory.total:
            raise Abort(
                Status.RESOURCE_EXHAUSTED,
                f"open.history: {len(op.history)} tokens and {op.reserve_tokens} new need {need} bytes of KV memory "
                f"(with {self.headroom} rows for a tree), this verifier holds at most {self.kv_memory.total}",
            )
        if self.stalled():
            raise Abort(
                Status.UNAVAILABLE,
                f"verifier stalled: its model thread finished no forward in {self.stall_seconds:g} s",
            )
        try:
            sampling = SamplingParams(*op.sampling)
        except ValueError as e:
            raise Abort(Status.INVALID_ARGUMENT, f"open.sampling: {e}") from None
        key = (op.tenant, op.session_id)
        entry = self.sessions.get(key)
        if entry is not None and entry.streaming:
            raise Abort(Status.ABORTED, f"session {op.session_id}: another stream is open on it")
        while entry is None and len(self.sessions) >= self.max_sessions:
            if not self._evict_session(key):
                raise Abort(Status.RESOURCE_EXHAUSTED, "verifier full: every KV cache is in use by a stream")
        if entry is None:
            session = VerifierSession(self.model, self.topk, self.backend, sampling, capacity=0)
            entry = self.sessions.put(Entry(op.tenant, op.session_id, session=session))
        entry.session.set_sampling(sampling)
        entry.scope = op.scope or op.tenant
        self.sessions.claim(entry)
        M.VERIFIER_SESSIONS.set(len(self.sessions))
        return entry

    def _evict(self, keep: tuple[str, str]) -> bool:
        """Makes room in KV memory: drops the least recently used of the prefix cache's unpinned
        blocks and the idle caches other than ``keep``'s. False when none is left."""
        block = self.prefix.oldest() if self.prefix is not None else None
        victim = self.sessions.idle_lru(keep)
        if block is not None and (victim is None or block.last_used <= victim.last_used):
            self._evict_block(block)
            return True
        return self._evict_session(keep)

    def _evict_block(self, block) -> None:
        self.prefix.evict(block)
        self.kv_memory.shrink(PREFIX_KEY, self.prefix.nbytes)
        M.PREFIX_EVICTED_BLOCKS.inc()
        M.PREFIX_BYTES.set(self.prefix.nbytes)

    def _evict_session(self, keep: tuple[str, str]) -> bool:
        """Drops the least recently used idle cache other than ``keep``'s: False when none is left."""
        victim = self.sessions.idle_lru(keep)
        if victim is None:
            return False
        self.sessions.pop(victim.key)
        self.kv_memory.release(victim.key)
        M.EVICTIONS.labels("capacity").inc()
        return True

    async def _reserve(self, entry: Entry, rows: int, timeout: float | None, what: str) -> None:
        """Makes ``entry``'s reservation at least ``rows`` rows (waiting for room if need be); a smaller
        one is applied by ``_shrunk`` once the cache has really shrunk."""
        if rows > entry.reserved_rows:
            await self.kv_memory.reserve(entry.key, self.kv_memory.bytes_for(rows), timeout, what)
            entry.reserved_rows = rows
        entry.session.set_reserved_rows(rows)

    def _rows_for(self, entry: Entry, need: int) -> int:
        """Rows the session's cache holds for an open that needs ``need``. A kept session's later turn
        (its cache holds rows already) keeps them where they suffice with at most a headroom to
        spare; where they do not, it grows to the need and one headroom more, if free KV memory
        allows, so that the next turns fit without moving the cache (a new cache is zeroed and the
        old one copied: 35 ms for 2,200 rows of the bundled model on two Zen 3 cores, a third of a
        continued turn's open). A first open, a shrinking one and the hf backend's cache (which holds
        only its committed rows) take exactly the need."""
        held = getattr(entry.session.backend, "capacity", 0)
        if not held or not entry.tokens or held > need + self.headroom:
            return need
        if need <= held:
            return held
        more = need + self.headroom
        mem = self.kv_memory
        free = mem.total - mem.used + mem.held.get(entry.key, 0)
        return more if mem.bytes_for(more) <= free else need

    def _shrunk(self, entry: Entry, rows: int) -> None:
        """The cache now has at most ``rows`` rows: the rest of its reservation is given back."""
        if rows < entry.reserved_rows and self.sessions.get(entry.key) is entry:
            entry.reserved_rows = rows
            self.kv_memory.shrink(entry.key, self.kv_memory.bytes_for(rows))

    def prefix_held(self) -> list[int]:
        """The prefix cache's blocks as gateways see them (``common.prefix.key_id``)."""
        return self.prefix.held() if self.prefix is not None else []

    @property
    def prefix_bytes(self) -> int:
        """KV memory the prefix cache holds (given back first when sessions need room)."""
        return self.kv_memory.held.get(PREFIX_KEY, 0)

    def _prefix_match(self, entry: Entry, history: list[int], reuse: int) -> Match | None:
        """The prefix cache's longest block prefix of ``history`` past the session's own ``reuse``
        rows (pinned until copied), counted as a hit; None, counted as a miss, when it has none.
        Not looked up (None, uncounted) when the session's own cache leaves less than a block, nor
        for an open that echoes its prompt's log-probabilities (copied rows compute none)."""
        cache = self.prefix
        if cache is None or not entry.session.prefix_exact or len(history) - 1 - reuse < cache.block:
            return None
        if getattr(entry.session, "echo", False):
            return None
        match = cache.match(entry.scope, history, len(history) - 1)  # at least one token is fed
        if match.tokens <= reuse:
            cache.unpin(match)
            M.PREFIX_LOOKUPS.labels("miss").inc()
            return None
        M.PREFIX_LOOKUPS.labels("hit").inc()
        M.PREFIX_SAVED_TOKENS.inc(match.tokens - reuse)
        return match

    def _prefix_insert(self, entry: Entry, history: list[int]) -> None:
        """Copies the full blocks of ``history`` the prefix cache lacks from the session's cache
        (just prefilled) into it, as far as free KV memory (and its own oldest blocks) allow: on the
        model thread, in the tenant's turn after the prefill, so the forward is not delayed by it."""
        cache, session, mem = self.prefix, entry.session, self.kv_memory
        if cache is None or not session.prefix_exact or mem.waiting:  # who waits for memory goes first
            return
        keys, first = cache.missing(entry.scope, history)
        want = len(keys) - first
        if want <= 0:
            return
        chain = set(keys[:first])  # the new blocks' parents: evicting one would strand them
        while mem.used + want * cache.block_bytes > mem.total:
            oldest = cache.oldest()
            if oldest is None or oldest.key in chain:
                break
            self._evict_block(oldest)
        fit = min(want, max(0, (mem.total - mem.used) // cache.block_bytes))
        if fit <= 0:
            return
        blocks = cache.add(keys, history, first, fit, entry.scope)
        held = cache.nbytes
        if not mem.try_reserve(PREFIX_KEY, held):  # cannot fail: it fits in free memory
            cache.discard(blocks)
            return
        M.PREFIX_BYTES.set(held)
        size, cuts = cache.block, session.cuts
        spans = [(i * size, (i + 1) * size) for i in range(first, first + fit)]

        def copy():
            if session.cuts != cuts or session.length < spans[-1][1]:
                raise RowsMoved  # a later open truncated the cache: its rows may be other tokens' now
            return [session.read_rows(s, e) for s, e in spans]

        job = self.model_thread.submit(entry.tenant, 1, "resize", copy)
        loop = asyncio.get_running_loop()
        job.add_done_callback(lambda f: loop.call_soon_threadsafe(self._prefix_filled, blocks, f))

    def _prefix_filled(self, blocks, job) -> None:
        if not job.cancelled() and job.exception() is None:
            self.prefix.fill(blocks, job.result())
            return
        self.prefix.discard(blocks)
        self.kv_memory.shrink(PREFIX_KEY, self.prefix.nbytes)
        M.PREFIX_BYTES.set(self.prefix.nbytes)

    async def open(
        self,
        entry: Entry,
        history: list[int],
        timeout: float | None = None,
        reserve_tokens: int = 0,
        prompt_topk: int | None = None,
        source: tuple[str, int] | None = None,
    ) -> Prefilled:
        """Keeps the longest prefix of ``history`` the cache holds, copies the prefix cache's blocks
        past it (``prefix_cache.py``; first fetched from ``source``, (address, blocks) of another
        verifier holding them, where that is cheaper: ``_prefix_fetch``) and prefills the rest, in
        chunks of ``prefill_chunk`` tokens, each its own job in the tenant's fair turn on the model
        thread; then offers the history's
        new full blocks to the prefix cache. ``prompt_topk``: at most this many prompt rows' top-k,
        the last ones (None: ``self.prompt_topk``'s)."""
        have = entry.tokens
        common = 0
        for a, b in zip(have, history):
            if a != b:
                break
            common += 1
        reuse = min(common, len(history) - 1)  # at least one token is fed: its logits pick the next
        t0 = time.perf_counter()
        pad = entry.session.rows_needed(0) - entry.session.length  # rows a forward writes past its own
        rows = self._rows_for(entry, len(history) + reserve_tokens + self.headroom + pad)
        try:
            await self._reserve(entry, rows, timeout, f"open of session {entry.session_id}")
        except BaseException:
            if not entry.tokens:  # nothing cached: keep no empty entry around
                self._forget(entry)
            raise
        # Whatever happens to this call, the cache's first ``len(entry.tokens)`` rows stay valid: the
        # work only truncates to them and appends. A cancelled stream (the worker may still run a
        # chunk) thus keeps a cache the next open can reuse.
        entry.tokens = have[:reuse]
        fetched = 0
        if source is not None:
            fetched = await self._prefix_fetch(entry, history, reuse, source, timeout)
        match = self._prefix_match(entry, history, reuse)
        t_prefill = time.perf_counter()
        start = reuse if match is None else match.tokens  # the first token to prefill
        res, topk = await self._prefill_chunks(entry, history, reuse, start, rows, match, prompt_topk)
        elapsed = (time.perf_counter() - t0) * 1e3
        M.PREFILL_SECONDS.observe(elapsed / 1e3)
        M.REUSED_TOKENS.inc(reuse)
        prefilled = len(history) - start
        if self.prefix is not None and prefilled >= self.prefix.block:  # what the fetch rule weighs against
            self.rates.prefilled(prefilled, time.perf_counter() - t_prefill)
            M.PREFIX_PREFILL_PER_TOKEN.set(self.rates.prefill_per_token)
        self._prefix_insert(entry, history)
        self._gauge()
        fetched = min(fetched, max(0, start - reuse))
        return Prefilled(res.next_token, topk, reuse, len(entry.tokens), elapsed, res.logprobs, start - reuse, fetched)

    async def _prefill_chunks(
        self, entry: Entry, history: list[int], reuse: int, start: int, rows: int, match, prompt_topk: int | None
    ):
        """``history[start:]`` prefilled in chunks of ``prefill_chunk``, each its own job; the first
        truncates the cache to ``reuse``, sizes it to the ``rows`` reserved and copies the prefix
        cache's blocks of ``match`` past the session's own (``entry.tokens`` follows). The last chunk's
        result and the top-k ids of the prompt rows asked for."""
        session = entry.session
        size = self.prefix.block if self.prefix is not None else 0
        cached = [] if match is None else [(i * size, b.rows) for i, b in enumerate(match.blocks)]
        new = history[start:]
        chunks = [new[i : i + self.prefill_chunk] for i in range(0, len(new), self.prefill_chunk)]
        topk: list[int] = []
        res = None
        most = self._prompt_rows(prompt_topk)

        def prepare():
            session.truncate(reuse)
            session.resize(rows)  # exactly the reservation: grows, or gives back spare rows
            for first, block in cached:  # the prefix cache's rows past the session's own
                skip = max(0, reuse - first)
                if skip < size:
                    session.write_rows(block, skip)

        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            after = max(0, len(new) - (i + 1) * self.prefill_chunk)  # prompt tokens after this chunk
            top = None if most is None else most - after  # the prefill clamps it to the chunk
            try:
                # maybe in one forward with other sessions' waiting prompts (``PrefillBatcher``)
                res = await self.prefills.prefill(
                    entry.tenant, session, chunk, last, prepare if i == 0 else None, topk_rows=top
                )
            except asyncio.CancelledError:
                raise
            except BaseException:
                self._forget(entry)  # a forward that failed halfway leaves the cache unknown
                raise
            finally:
                if i == 0 and match is not None:
                    self.prefix.unpin(match)  # copied (the job holds its rows while it runs)
            if i == 0:
                self._shrunk(entry, rows)
                entry.tokens = history[:start]  # the cache's copy ran with the first chunk
            entry.tokens.extend(chunk)
            topk.extend(t for row in res.topk for t in row)
        return res, topk

    def _prompt_rows(self, asked: int | None) -> int | None:
        """The prompt rows an open sends the top-k of: at most ``asked`` and this verifier's
        ``prompt_topk`` (None: no bound)."""
        bounds = [b for b in (asked, self.prompt_topk) if b is not None]
        return min(bounds) if bounds else None

    async def verify(self, entry: Entry, tokens: list[int], parents: list[int]) -> Verified:
        """One tree of the session's, alone or batched with other sessions' trees."""
        if len(tokens) > MAX_TREE:
            raise Abort(Status.INVALID_ARGUMENT, f"tree.tokens: {len(tokens)} nodes, at most {MAX_TREE}")
        t0 = time.perf_counter()
        need = entry.session.rows_needed(len(tokens))
        if need > entry.reserved_rows:  # grows by a reservation, with headroom so it does not every round
            await self._reserve(entry, need + self.headroom, None, f"tree of session {entry.session_id}")
        try:
            res, forward_ms, others = await self.batcher.verify(entry, tokens, parents)
        except asyncio.CancelledError:
            raise  # the forward only appends after ``entry.tokens`` (same worker thread): they stay a valid prefix
        except BaseException:
            self._forget(entry)  # the forward may or may not have run: the cache is unknown
            raise
        if isinstance(res, ValueError):  # validated before the forward: the cache is untouched
            raise Abort(Status.INVALID_ARGUMENT, f"tree: {res}")
        n, length = len(tokens), len(entry.tokens)
        entry.tokens.extend(tokens[i] for i in res.accepted)
        if others == 0:  # a batch's forward is not one tree's
            follow(self.cost, self.slope, n, length, forward_ms)
        entry.touch()
        elapsed = (time.perf_counter() - t0) * 1e3
        M.VERIFY_SECONDS.observe(elapsed / 1e3)
        return Verified(
            res.bonus,
            res.accepted,
            [t for row in res.topk for t in row],
            len(entry.tokens),
            elapsed,
            others,
            res.logprobs,
        )

    def streaming(self) -> int:
        return self.sessions.streaming()

    def release(self, entry: Entry) -> None:
        """The stream is over: the idle cache gives back its spare rows (on the model thread, after
        the stream's own jobs; KV memory follows once it has)."""
        self.sessions.release(entry)
        current = self.sessions.get(entry.key)
        if current is None:  # dropped while it streamed (a growth may have reserved again since)
            self.kv_memory.release(entry.key)
        self.kv_memory.wake()  # an idle cache may be evicted for those waiting
        if current is not entry or entry.reserved_rows <= len(entry.tokens):
            return
        rows = len(entry.tokens)
        entry.session.set_reserved_rows(rows)

        def trim():
            if entry.session.backend.reserved_rows == rows:  # no open since
                # A job of a cancelled stream may have run on and written rows past ``entry.tokens``:
                # they are not counted, so they go before the cache shrinks to the reservation.
                entry.session.truncate(rows)
                entry.session.resize(rows)

        job = self.model_thread.submit(entry.tenant, 1, "resize", trim)
        loop = asyncio.get_running_loop()

        def done(f):
            if not f.cancelled() and f.exception() is None:
                loop.call_soon_threadsafe(self._trimmed, entry, rows)

        job.add_done_callback(done)

    def _trimmed(self, entry: Entry, rows: int) -> None:
        if not entry.streaming:  # a new open keeps (or grows) the reservation it made
            self._shrunk(entry, rows)

    def _forget(self, entry: Entry) -> None:
        if self.sessions.get(entry.key) is entry:
            self.sessions.pop(entry.key)
            self.kv_memory.release(entry.key)
        self._gauge()

    def _gauge(self) -> None:
        M.VERIFIER_SESSIONS.set(len(self.sessions))
        M.CACHE_TOKENS.set(sum(len(e.tokens) for e in self.sessions))

    async def expire(self) -> int:
        gone = self.sessions.expire()
        for e in gone:
            self.kv_memory.release(e.key)
        M.EVICTIONS.labels("idle").inc(len(gone))
        self._gauge()
        return len(gone)

    def drop(self, tenant: str, session_id: str) -> bool:
        entry = self.sessions.pop((tenant, session_id))
        if entry is not None:
            self.kv_memory.release(entry.key)
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
        self.model_thread.close()
