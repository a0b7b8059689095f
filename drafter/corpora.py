"""The drafter's tenant corpora, shared by every replica through a capped stream per tenant.

Each tenant that shares has one stream in the store (``racer:corpus:<tenant>``). A response is
published to it in chunks as it streams (``append`` buffers, ``sync`` writes); the stream is bounded
in tokens like the corpus (entries whose tokens have all left the corpus are trimmed) and expires
``stream_ttl`` seconds after its last write (each write sets it again). Every replica
that holds the tenant's corpus reads the stream incrementally and indexes what it reads, its own
chunks included: one path for every token, so all replicas index the same tokens in the same
order. A replica loads a tenant's corpus (the whole stream, indexed in a worker thread) when the
tenant's first session arrives there and drops it when the tenant has been idle; a restarted
replica loads it again. Nothing here runs on the drafting path: a step reads the corpus as it is.

Erasing bumps the tenant's epoch (``racer:corpus:<tenant>:epoch``) and deletes the stream. Every
record carries the epoch it was written in, and a record older than the epoch is never indexed, so
a chunk a replica publishes after the erase (from a turn that began before it) does not bring the
old text back. Each replica checks the epoch at every sync and empties its copy when it moved.

A record read back is checked before use (magic, sizes, token range), as snapshots are.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from common.logs import Throttled

from . import metrics as M
from .corpus import TOKEN_LIMIT, Corpus, CorpusConfig

log = logging.getLogger("racer.drafter")

MAGIC = b"RC1"
_HEAD = struct.Struct("<IQQI")  # epoch, replica, response number, tokens
MAX_CHUNK = 4096  # tokens a record may carry
_REMOTE_WRITERS = 4096  # responses being read back whose continuation is kept (LRU)


class CorpusRecordError(ValueError):
    pass


def encode(epoch: int, replica: int, number: int, tokens) -> bytes:
    arr = np.asarray(tokens, dtype="<i4")
    return MAGIC + _HEAD.pack(epoch, replica, number, arr.size) + arr.tobytes()


def decode(data: bytes) -> tuple[int, int, int, np.ndarray]:
    """(epoch, replica, response number, tokens) of a record; ``CorpusRecordError`` if malformed."""
    if not isinstance(data, (bytes, bytearray)) or data[:3] != MAGIC or len(data) < 3 + _HEAD.size:
        raise CorpusRecordError("not a corpus record")
    epoch, replica, number, n = _HEAD.unpack_from(data, 3)
    if n > MAX_CHUNK or len(data) != 3 + _HEAD.size + 4 * n:
        raise CorpusRecordError(f"corpus record: {n} tokens in {len(data)} bytes")
    tokens = np.frombuffer(data, dtype="<i4", offset=3 + _HEAD.size).astype(np.int64)
    if n and (tokens.min() < 0 or tokens.max() >= TOKEN_LIMIT):
        raise CorpusRecordError("corpus record: token id out of range")
    return epoch, replica, number, tokens


def stream_key(tenant: str) -> str:
    return f"racer:corpus:{tenant}"


def epoch_key(tenant: str) -> str:
    return f"racer:corpus:{tenant}:epoch"


@dataclass(eq=False)
class Response:
    """One turn's response on its way to the tenant's stream."""

    tenant: str
    number: int
    epoch: int | None  # the tenant's epoch when it began (None: not known yet); -1: erased
    pending: list[int] = field(default_factory=list)
    done: bool = False


@dataclass(eq=False)
class TenantCorpus:
    max_tokens: int
    used: float  # when a session of the tenant last opened or streamed here
    corpus: Corpus | None = None  # None while loading
    last_id: str = "0"  # the last stream entry indexed
    epoch: int = 0
    writers: OrderedDict = field(default_factory=OrderedDict)  # (replica, number) -> Writer
    loading: asyncio.Task | None = None
    # (stream id, corpus position): the first entry of each batch indexed and where its tokens
    # began. Every token of the entries before a mark whose position is dead has left the corpus:
    # the stream is trimmed up to that mark, so it holds the corpus's live tokens and one batch.
    marks: deque = field(default_factory=deque)


class Corpora:
    def __init__(self, max_tokens: int = 1 << 20, idle_s: float = 600.0, store=None, stream_ttl: float = 7 * 86400.0):
        self.max_tokens = max_tokens  # the default bound per tenant; 0: no corpus at all
        self.idle_s = idle_s
        self.store = store
        self.stream_ttl = stream_ttl  # seconds a tenant's stream outlives its last write
        self.replica = int.from_bytes(os.urandom(8), "little") >> 1
        self.tenants: dict[str, TenantCorpus] = {}
        self.responses: list[Response] = []  # with tokens not yet published
        self._numbers = 0
        self._warnings = Throttled(log)
        self._lock = asyncio.Lock()  # one sync at a time

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 and self.store is not None

    # -- the drafting side (no I/O) -------------------------------------------------------------
    def current(self, tenant: str) -> Corpus | None:
        tc = self.tenants.get(tenant)
        return tc.corpus if tc is not None else None

    def append(self, resp: Response, tokens) -> None:
        """A response's newly committed tokens: published at the next sync. ``ValueError``, and
        nothing taken, if one is outside the ids a corpus holds ([0, TOKEN_LIMIT)): every token
        that enters a response is checked here, before it can spoil the record it would go out in."""
        tokens = list(tokens)
        if any(not 0 <= t < TOKEN_LIMIT for t in tokens):
            raise ValueError(f"token id out of range for the tenant corpus: [0, {TOKEN_LIMIT})")
        tc = self.tenants.get(resp.tenant)
        if tc is not None:
            tc.used = time.monotonic()
        if resp.epoch is None or resp.epoch >= 0:
            resp.pending.extend(tokens)

    def finish(self, resp: Response) -> None:
        resp.done = True

    # -- sessions arriving, tenants leaving ----------------------------------------------------
    async def open(self, tenant: str, max_tokens: int = 0, share: bool = True) -> Response | None:
        """A session of ``tenant`` opens: its corpus is brought up to date (loaded in the background
        at the tenant's first session); the Response its tokens go to when ``share``."""
        if not self.enabled:
            return None
        tc = self.tenants.get(tenant)
        if tc is None:
            tc = self.tenants[tenant] = TenantCorpus(max_tokens or self.max_tokens, time.monotonic())
            tc.loading = asyncio.ensure_future(self._load(tenant, tc))
            M.CORPUS_TENANTS.set(len(self.tenants))
        else:
            tc.used = time.monotonic()
            if tc.corpus is not None:
                try:
                    await self.sync([tenant])  # what this tenant's other sessions wrote, up to now
                except Exception as e:  # noqa: BLE001 - the store is down: draft from what is held
                    self._warnings.warning("corpus sync failed", tenant=tenant, error=repr(e))
        if not share:
            return None
        self._numbers += 1
        resp = Response(tenant, self._numbers, tc.epoch if tc.corpus is not None else None)
        self.responses.append(resp)
        return resp

    def expire(self, busy: set[str] = frozenset(), now: float | None = None) -> list[str]:
        """Drops the corpora of tenants idle longer than ``idle_s`` (never one in ``busy``); the
        stream stays, for the tenant's next session."""
        now = time.monotonic() if now is None else now
        gone = [t for t, tc in self.tenants.items() if now - tc.used > self.idle_s and t not in busy]
        for t in gone:
            self._forget(t)
        return gone

    async def erase(self, tenant: str) -> bool:
        """Erases the tenant's corpus here, in the store, and (at their next sync) on every replica."""
        existed = tenant in self.tenants
        self._forget(tenant)
        for r in self.responses:
            if r.tenant == tenant:
                r.pending.clear()
                r.epoch = -1  # nothing more of it is published
        if self.store is not None:
            await self.store.incr(epoch_key(tenant))
            existed = await self.store.xdelete(stream_key(tenant)) or existed
        return existed

    def _forget(self, tenant: str) -> None:
        tc = self.tenants.pop(tenant, None)
        if tc is not None and tc.loading is not None:
            tc.loading.cancel()
        try:
            M.CORPUS_TOKENS.remove(tenant)
        except KeyError:
            pass
        M.CORPUS_TENANTS.set(len(self.tenants))
        M.CORPUS_BYTES.set(self.nbytes())

    # -- the store side --------------------------------------------------------------------------
    async def _load(self, tenant: str, tc: TenantCorpus) -> None:
        t0 = time.perf_counter()
        try:
            epoch = int((await self.store.get(epoch_key(tenant))) or 0)
            pages, last = [], "0"
            while True:
                got = (await self.store.xread({stream_key(tenant): last}, 1000)).get(stream_key(tenant), [])
                if not got:
                    break
                pages.append(got)
                last = got[-1][0]
            corpus = Corpus(CorpusConfig(max_tokens=tc.max_tokens))
            writers: OrderedDict = OrderedDict()
            marks: deque = deque()
            for page in pages:
                marks.append((page[0][0], corpus.total))
                await asyncio.to_thread(self._index_all, corpus, writers, page, epoch)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the tenant drafts without a corpus until the next try
            self._warnings.warning("corpus load failed", tenant=tenant, error=repr(e))
            if self.tenants.get(tenant) is tc:
                del self.tenants[tenant]
            return
        if self.tenants.get(tenant) is not tc:
            return  # erased or dropped meanwhile
        tc.corpus, tc.writers, tc.last_id, tc.epoch, tc.loading = corpus, writers, last, epoch, None
        tc.marks = marks
        await self._trim(tenant, tc)
        M.CORPUS_LOAD_SECONDS.observe(time.perf_counter() - t0)
        M.CORPUS_TOKENS.labels(tenant).set(len(corpus))
        M.CORPUS_BYTES.set(self.nbytes())

    def _index_all(self, corpus: Corpus, writers: OrderedDict, records, epoch: int) -> int:
        """Indexes records (stream order); returns the ones skipped. Runs in a worker thread on a
        corpus nobody else sees yet, or on the event loop."""
        skipped = 0
        for _, data in records:
            try:
                rec_epoch, replica, number, tokens = decode(data)
            except CorpusRecordError as e:
                M.CORPUS_RECORD_FAILURES.inc()
                self._warnings.warning("corpus record unusable; skipped", error=str(e)[:200])
                skipped += 1
                continue
            if rec_epoch < epoch:
                skipped += 1
                continue
            key = (replica, number)
            w = writers.pop(key, None) or corpus.writer()
            writers[key] = w
            if len(writers) > _REMOTE_WRITERS:
                writers.popitem(last=False)
            corpus.append(w, tokens)
        return skipped

    async def sync(self, only: list[str] | None = None) -> None:
        """Checks the epochs, publishes waiting chunks and indexes what the streams gained
        (``only``: these tenants)."""
        if not self.enabled:
            return
        async with self._lock:
            pending = {r.tenant for r in self.responses if r.pending or r.done}
            names = (set(self.tenants) | pending) if only is None else set(only)
            epochs = {t: int((await self.store.get(epoch_key(t))) or 0) for t in names}
            for t, epoch in epochs.items():
                tc = self.tenants.get(t)
                if tc is not None and tc.corpus is not None and epoch > tc.epoch:  # erased elsewhere
                    tc.corpus = Corpus(CorpusConfig(max_tokens=tc.max_tokens))
                    tc.writers.clear()
                    tc.marks.clear()
                    tc.epoch, tc.last_id = epoch, "0"
                    M.CORPUS_TOKENS.labels(t).set(0)
            await self._publish(epochs)
            loaded = {t: tc for t, tc in self.tenants.items() if tc.corpus is not None and t in names}
            if not loaded:
                return
            got = await self.store.xread({stream_key(t): tc.last_id for t, tc in loaded.items()}, 4096)
            now = time.time()
            for key, entries in got.items():
                t = key[len("racer:corpus:") :]
                tc = self.tenants.get(t)
                if tc is None or tc.corpus is None or not entries:
                    continue
                t0 = time.perf_counter()
                tc.marks.append((entries[0][0], tc.corpus.total))
                self._index_all(tc.corpus, tc.writers, entries, tc.epoch)
                M.CORPUS_INDEX_SECONDS.observe(time.perf_counter() - t0)
                tc.last_id = entries[-1][0]
                await self._trim(t, tc)
                M.CORPUS_TOKENS.labels(t).set(len(tc.corpus))
                ms = entries[-1][0].split("-")[0]  # Redis: the writer's clock in ms (the memory store counts)
                if len(ms) >= 13:
                    M.CORPUS_LAG_SECONDS.observe(max(0.0, now - int(ms) / 1e3))
            M.CORPUS_BYTES.set(self.nbytes())

    async def _publish(self, epochs: dict[str, int]) -> None:
        """Writes the waiting tokens of the responses of ``epochs``' tenants, tagged with the epoch;
        a response begun before its tenant's last erase publishes nothing more."""
        keep = []
        for r in self.responses:
            epoch = epochs.get(r.tenant)
            if epoch is not None:
                if r.epoch is None:
                    r.epoch = epoch
                if r.epoch < epoch:  # erased since it began
                    r.epoch, r.pending = -1, []
            if r.epoch is not None and r.epoch < 0:
                continue
            if epoch is not None:
                tc = self.tenants.get(r.tenant)
                # A backstop in entries that never drops a live token (an entry holds at least one);
                # the bound in tokens is kept by ``_trim``.
                cap = (tc.max_tokens if tc is not None else self.max_tokens) + 1
                while r.pending:
                    chunk = r.pending[:MAX_CHUNK]
                    record = encode(epoch, self.replica, r.number, chunk)
                    try:
                        await self.store.xadd(stream_key(r.tenant), record, cap, self.stream_ttl)
                    except Exception as e:  # noqa: BLE001 - a lost chunk costs draft quality, never output
                        M.CORPUS_RECORD_FAILURES.inc()
                        self._warnings.warning("corpus publish failed", tenant=r.tenant, error=repr(e))
                        break
                    del r.pending[: len(chunk)]
            if not (r.done and not r.pending):
                keep.append(r)
        self.responses = keep

    async def _trim(self, tenant: str, tc: TenantCorpus) -> None:
        """Drops the stream's entries whose every token has left the corpus (found by the marks), so
        the stream's bound counts tokens as the corpus's does. Every replica trims at the same
        entries (they index the same stream in the same order); with different bounds for one
        tenant, the smallest wins. A trim that fails is covered by the next one."""
        marks, start, cut = tc.marks, tc.corpus.start, None
        while len(marks) > 1 and marks[1][1] <= start:
            marks.popleft()
            cut = marks[0][0]
        if cut is None:
            return
        try:
            await self.store.xtrim(stream_key(tenant), cut)
        except Exception as e:  # noqa: BLE001 - the stream keeps a few dead entries until the next trim
            self._warnings.warning("corpus stream trim failed", tenant=tenant, error=repr(e))

    async def run(self, every: float = 0.25) -> None:
        """The background sync: every ``every`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(every)
            try:
                await self.sync()
            except Exception as e:  # noqa: BLE001 - the store is down: drafts go on from what is held
                self._warnings.warning("corpus sync failed", error=repr(e))

    def nbytes(self) -> int:
        """Bytes of the corpora held (their arrays), counted in the drafter's memory bound."""
        return sum(tc.corpus.nbytes() for tc in self.tenants.values() if tc.corpus is not None)
