"""Prefix blocks between verifiers, the verifier's side: fetching the blocks of a prompt another
verifier holds (at an open, where that is cheaper than their prefill), a moving session's own rows
handed over off a draining verifier, serving both to other verifiers, and a joining verifier's
warm-up from the hottest chains of another. Every block is checked before it is taken (fingerprint,
scope, key, hash chain, size) and its KV memory reserved before a byte arrives; the rule and the
wire format are ``prefix_fetch.py``'s. ``Verifier`` (``sessions.py``) takes these methods; they read
its prefix cache, KV memory, sessions and settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from common.errors import Abort, Status
from common.prefix import child_key

from . import metrics as M
from .entry import Entry
from .gguf_blocks import cache_dtype
from .prefix_fetch import Ask, Clock, Header, Rates, Refused, WireBlock, faults, fingerprint, layout, link, pack, seed
from .prefix_fetch import unpack as unpack_rows
from .tuning import kernel_plan

log = logging.getLogger("racer.verifier")

PREFIX_KEY = ("", "prefix cache")  # the prefix cache's reservation in KV memory (no tenant is empty)
WARM_KEY = ("", "prefix warm-up")  # a warm-up's blocks' memory, reserved before the first byte arrives
HANDOVER_GROUP = 8  # a session's blocks read from its cache per model-thread job, when handed over


class RowsMoved(Exception):
    """A session's rows changed before their copy into the prefix cache ran: nothing is copied."""


class _Sent:
    """A transfer of blocks being sent: its digest chain, its metrics, and the test faults."""

    def __init__(self, verifier: "PrefixTransfer", ask: Ask, prev: bytes, total: int):
        self.verifier, self.ask, self.prev, self.total, self.count = verifier, ask, prev, total, 0

    def block(self, index: int, key: bytes, scope: str, rows, tokens=(), parent: bytes = b"") -> WireBlock:
        v = self.verifier
        if self.count == 1 and self.total > 1 and "stop-mid-transfer" in v.faults:
            os.kill(os.getpid(), signal.SIGSTOP)  # the first block went out: held half done
        self.count += 1
        data = pack(rows)
        self.prev = link(self.prev, key, data)
        if "corrupt" in v.faults:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        M.PREFIX_SERVED_BLOCKS.inc()
        M.PREFIX_SERVED_BYTES.inc(len(data))
        if self.ask.session:
            M.PREFIX_HANDOVER_ROWS.labels("sent").inc(v.prefix.block)
            M.PREFIX_HANDOVER_BYTES.labels("sent").inc(len(data))
        return WireBlock(index, key, scope, data, self.prev, tuple(tokens), parent)


def _chained(item: WireBlock, i: int, total: int, prev: bytes, max_bytes: int) -> tuple[int, bytes]:
    """Block ``i`` received: its bytes counted against ``max_bytes`` and its digest checked against
    the chain so far (``prev``); the new total and chain, or ``Refused``."""
    total += len(item.rows)
    if total > max_bytes:
        raise Refused("budget", f"more than {max_bytes} bytes")
    prev = link(prev, item.key, item.rows)
    if item.digest != prev:
        raise Refused("hash", f"block {i}'s digest does not chain")
    return total, prev


class PrefixTransfer:
    """The ``Verifier``'s prefix-block transfers (this module's docstring)."""

    def _init_transfers(
        self,
        setup,
        prefix_block: int,
        prefix_fetch: str,
        prefix_fetch_seconds: float,
        prefix_fetch_bytes: int,
        prefix_warm_share: float,
    ) -> None:
        """The transfers' settings and state (``Verifier.__init__``'s, once its prefix cache, KV memory
        and cost curve are set): the fetch rule's rates, and the fingerprint blocks move under."""
        if prefix_fetch not in ("auto", "always", "off"):
            raise ValueError(f"prefix_fetch: {prefix_fetch!r}, one of auto, always, off")
        self.prefix_fetch = prefix_fetch
        self.prefix_fetch_seconds = prefix_fetch_seconds
        self.prefix_fetch_bytes = prefix_fetch_bytes
        # fetcher(address, Ask, seconds): the Header, then the WireBlocks, of another verifier (the service's)
        self.fetcher = None
        if not 0.0 <= prefix_warm_share <= 1.0:
            raise ValueError(f"prefix_warm_share: {prefix_warm_share}, from 0 to 1")
        self.prefix_warm_share = prefix_warm_share
        self.warming = False  # a warm-up in progress (one at a time)
        self.warmed = 0  # blocks warm-ups took in: a warm verifier is not warmed again
        self.serving = 0  # PrefixBlocks transfers being sent
        # Sessions whose stream a drain refused (they move): the drain serves their hand-over first
        self.moving: set[tuple[str, str]] = set()
        self._background: set[asyncio.Future] = set()
        self.faults = faults()  # tests only: a holder that misbehaves (``prefix_fetch.FAULTS``)
        self.rates = Rates()
        if self.cost:  # until a prefill is measured: the largest tree's forward, per token
            n = max(self.cost)
            self.rates.prefilled(n, self.cost[n] / 1e3)
        self.fingerprint, self.row_layout = "", None
        if self.prefix is not None:
            self.row_layout = layout(self.model.config, setup.backend, cache_dtype(self.model), prefix_block)
            if self.row_layout.nbytes == self.prefix.block_bytes:
                if setup.backend == "llama":  # the plan its sessions will run, made now (the first
                    kernel_plan(self.model, held_ok=True)  # session's open would): the fingerprint names it
                self.fingerprint, what = fingerprint(self.model, setup, self.row_layout, prefix_block)
                log.info("prefix fingerprint", extra={"fingerprint": self.fingerprint, "of": what})
            else:  # rows not shaped as this module knows them: none move
                log.warning("prefix blocks do not move: rows of %s", self.row_layout.describe())

    async def _prefix_fetch(
        self, entry: Entry, history: list[int], reuse: int, source: tuple, timeout: float | None
    ) -> int:
        """Fetches the blocks of ``history`` the prefix cache lacks, up to the ``source``'s (address,
        blocks held[, session id: a hand-over of that session's own rows off a draining verifier]),
        from that verifier into the prefix cache, where the rule says it is cheaper than their prefill
        (``prefix_fetch.py``); the tokens fetched (0: the open prefills them). Their KV memory is
        reserved before a byte arrives; whatever fails or is refused is discarded. A hand-over not
        made tells the draining verifier so (``_decline``): its drain need not wait for it."""
        address, held, session = (*source, "")[:3]
        fetched = await self._fetch_blocks(entry, history, reuse, address, held, session, timeout)
        if session and fetched is None:
            self._decline(address, entry, session)
        return fetched or 0

    def _decline(self, address: str, entry: Entry, session: str) -> None:
        """A hand-over this open does not make: an empty request tells the draining verifier at
        ``address`` that ``session`` no longer waits for it (best effort, in the background)."""
        if self.fetcher is None or self.prefix is None or not self.fingerprint or not address:
            return
        ask = Ask(entry.tenant, entry.scope, [], 0, self.prefix.block, self.fingerprint, 0, session)

        async def tell():
            with contextlib.suppress(Exception):
                async for _ in self.fetcher(address, ask, self.prefix_fetch_seconds):
                    pass

        task = asyncio.ensure_future(tell())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _plan_fetch(
        self, entry: Entry, history: list[int], reuse: int, address: str, held: int, session: str, use: str
    ) -> tuple[Ask, list[bytes], list] | None:
        """What an open would fetch of ``history`` from the verifier at ``address`` (holding its first
        ``held`` blocks): (the ``Ask``, the chain keys, the blocks added for it, pinned, their KV memory
        reserved), or None where nothing is worth fetching or nothing fits."""
        cache, mem = self.prefix, self.kv_memory
        if (
            cache is None
            or self.fetcher is None
            or self.prefix_fetch == "off"
            or not self.fingerprint
            or not address
            or not entry.session.prefix_exact
            or getattr(entry.session, "echo", False)  # copied rows compute no log-probabilities
            or mem.waiting  # who waits for memory goes first
        ):
            return None
        size = cache.block
        end = min(held, (len(history) - 1) // size)  # at least one token is fed
        if end * size <= reuse:
            return None
        keys, first = cache.missing(entry.scope, history[: end * size])
        want = end - first
        if want <= 0:
            return None
        gain = end * size - max(reuse, first * size)  # tokens not prefilled
        if self.prefix_fetch == "auto" and not self.rates.worth(gain, want * cache.block_bytes):
            M.PREFIX_FETCH_DECISIONS.labels("prefill").inc()
            return None
        M.PREFIX_FETCH_DECISIONS.labels("fetch").inc()
        budget = min(self.prefix_fetch_bytes, want * cache.block_bytes)
        chain = set(keys[:first])  # the blocks' parents: evicting one would strand them
        while mem.used + budget > mem.total:
            oldest = cache.oldest()
            if oldest is None or oldest.key in chain:
                break
            self._evict_block(oldest)
        fit = min(want, budget // cache.block_bytes, max(0, mem.total - mem.used) // cache.block_bytes)
        if fit <= 0:
            self._refused(use, "budget")
            return None
        blocks = cache.add(keys, history, first, fit, entry.scope)
        if not mem.try_reserve(PREFIX_KEY, cache.nbytes):  # cannot fail: it fits in free memory
            self._prefix_dropped(blocks)
            return None
        M.PREFIX_BYTES.set(cache.nbytes)
        ask = Ask(
            entry.tenant,
            entry.scope,
            history[: (first + fit) * size],
            first,
            size,
            self.fingerprint,
            fit * cache.block_bytes,
            session,
        )
        return ask, keys, blocks

    async def _fetch_blocks(
        self, entry: Entry, history: list[int], reuse: int, address: str, held: int, session: str, timeout
    ) -> int | None:
        """``_prefix_fetch``'s transfer: the tokens fetched, 0 for a transfer that failed, None where
        none was asked for."""
        use = "handover" if session else "fetch"
        plan = self._plan_fetch(entry, history, reuse, address, held, session, use)
        if plan is None:
            return None
        ask, keys, blocks = plan
        cache, size, first, fit = self.prefix, self.prefix.block, ask.first, len(blocks)
        seconds = self.prefix_fetch_seconds if timeout is None else max(0.0, min(self.prefix_fetch_seconds, timeout))
        clock, rows = Clock(), None
        try:
            try:
                async with asyncio.timeout(seconds):
                    rows = await self._receive(address, ask, keys, seconds, clock)
            except TimeoutError:
                raise Refused("deadline", f"not done within {seconds:g} s") from None
        except Refused as e:
            self._refused(use, e.reason)
            log.warning(
                "prefix blocks refused", extra={"source": address, "use": use, "reason": e.reason, "detail": e.detail}
            )
        except Exception as e:  # noqa: BLE001 - a failing holder costs a prefill, nothing more
            self._refused(use, "source")
            log.warning("prefix blocks not fetched", extra={"source": address, "use": use, "error": repr(e)})
        finally:
            M.PREFIX_FETCH_SECONDS.observe(clock())
            if rows is None:
                self._prefix_dropped(blocks)
        if rows is None:
            return 0
        n = len(rows)
        cache.fill(blocks[:n], rows)
        if n < fit:
            self._prefix_dropped(blocks[n:])
        M.PREFIX_FETCHED_BLOCKS.inc(n)
        M.PREFIX_FETCHED_BYTES.inc(n * cache.block_bytes)
        if session:
            M.PREFIX_HANDOVER_ROWS.labels("received").inc(n * size)
            M.PREFIX_HANDOVER_BYTES.labels("received").inc(n * cache.block_bytes)
        if self.rates.bytes_per_second is not None:
            M.PREFIX_FETCH_RATE.set(self.rates.bytes_per_second)
        return max(0, (first + n) * size - max(reuse, first * size)) if n else 0

    @staticmethod
    def _refused(use: str, reason: str) -> None:
        M.PREFIX_FETCH_REFUSED.labels(reason).inc()  # every transfer's
        if use != "fetch":
            M.PREFIX_TRANSFER_REFUSED.labels(use, reason).inc()

    def _prefix_dropped(self, blocks) -> None:
        """Blocks added for a transfer that did not fill them: out of the cache, their memory given back."""
        self.prefix.discard(blocks)
        self.kv_memory.shrink(PREFIX_KEY, self.prefix.nbytes)
        M.PREFIX_BYTES.set(self.prefix.nbytes)

    async def _receive(self, address: str, ask: Ask, keys: list[bytes], seconds: float, clock: Clock) -> list:
        """The rows of ``ask``'s blocks from the verifier at ``address``, each checked (scope, key,
        chained digest, size) before it is taken; ``Refused`` at the first that fails."""
        header, out, total, setup = None, [], 0, 0.0
        prev = seed(self.fingerprint, ask.scope)
        async for item in self.fetcher(address, ask, seconds):
            if header is None:
                header, setup = self._checked_header(item, ask), clock()
                continue
            i = ask.first + len(out)
            if not isinstance(item, WireBlock) or len(out) >= header.blocks or item.index != i:
                raise Refused("source", f"out of order where block {i} of {ask.first + header.blocks} was due")
            if item.scope != ask.scope:
                raise Refused("scope", f"block {i} is of another scope")
            if item.key != keys[i]:
                raise Refused("hash", f"block {i}'s key is not its tokens' in this scope")
            total, prev = _chained(item, i, total, prev, ask.max_bytes)
            out.append(unpack_rows(item.rows, self.row_layout))
        if header is None or len(out) < header.blocks:
            raise Refused("source", "the transfer ended early")
        if out:
            self.rates.fetched(total, setup, clock())
        return out

    async def serve_prefix(self, ask: Ask):
        """The ``Header``, then the ``WireBlock``s, of the blocks ``ask.first`` .. of ``ask.tokens``
        this prefix cache holds in ``ask``'s scope (at most ``ask.max_bytes`` of rows), for another
        verifier whose fingerprint is this one's; pinned while they are sent. A hand-over
        (``ask.session``) goes on past them with the session's own committed rows; a warm-up
        (``ask.hottest``) sends the most recently used chains instead (``_serve_hottest``)."""
        try:
            self._serving_checks(ask)
            self.serving += 1
            try:
                items = self._serve_hottest(ask) if ask.hottest else self._serve_prompt(ask)
                async with contextlib.aclosing(items) as sent:
                    async for item in sent:
                        yield item
            finally:
                self.serving -= 1
        finally:
            if ask.session:  # handed over, refused, or given up by the receiver: the drain waits no longer
                self.moving.discard((ask.tenant, ask.session))

    def _serving_checks(self, ask: Ask) -> None:
        cache = self.prefix
        if cache is None or not self.fingerprint:
            raise Abort(Status.FAILED_PRECONDITION, "prefix blocks: this verifier keeps none")
        if not ask.tenant and not ask.hottest:
            raise Abort(Status.INVALID_ARGUMENT, "prefix blocks: tenant required", field="tenant")
        if ask.first < 0:
            raise Abort(Status.INVALID_ARGUMENT, f"first_block: {ask.first}, at least 0", field="first_block")
        if ask.block != cache.block or ask.fingerprint != self.fingerprint:
            M.PREFIX_SERVE_REFUSED.labels("fingerprint").inc()
            raise Abort(
                Status.FAILED_PRECONDITION,
                f"prefix blocks: fingerprint {ask.fingerprint!r} of {ask.block}-token blocks; this verifier's is "
                f"{self.fingerprint!r} of {cache.block}",
                field="fingerprint",
            )

    async def _serve_prompt(self, ask: Ask):
        cache = self.prefix
        scope = ask.scope or ask.tenant
        limit = (len(ask.tokens) // cache.block) * cache.block
        if "ignore-scope" in self.faults:
            match = cache.match_any_scope(ask.tokens, limit)
        else:
            match = cache.match(scope, ask.tokens, limit)
        try:
            chosen = match.blocks[ask.first :]
            if "ignore-scope" not in self.faults:  # keys carry the scope; the blocks say it too
                chosen = chosen[: next((i for i, b in enumerate(chosen) if b.scope != scope), len(chosen))]
            start = ask.first + len(chosen)
            entry, keys, end = self._own_blocks(ask, scope, start) if ask.session else (None, [], start)
            most = max(0, ask.max_bytes) // cache.block_bytes
            if most < len(chosen) + end - start:
                if ask.max_bytes > 0:  # 0: a receiver telling a draining verifier it takes nothing
                    M.PREFIX_SERVE_REFUSED.labels("budget").inc()
                if most <= len(chosen):  # the session's blocks would not follow on: none of them
                    chosen, end = chosen[:most], start
                else:
                    end = start + most - len(chosen)
            yield Header(self.fingerprint, len(chosen) + end - start, cache.block_bytes)
            sent = _Sent(self, ask, seed(self.fingerprint, scope), len(chosen) + end - start)
            for i, b in enumerate(chosen):
                yield sent.block(ask.first + i, b.key, b.scope, b.rows)
            if entry is None or end <= start:
                return
            session, cuts, size = entry.session, entry.session.cuts, cache.block
            for g in range(start, end, HANDOVER_GROUP):
                spans = [(i * size, (i + 1) * size) for i in range(g, min(end, g + HANDOVER_GROUP))]

                def read(spans=spans):
                    if session.cuts != cuts or session.length < spans[-1][1]:
                        raise RowsMoved  # an open truncated the cache since: its rows may be other tokens' now
                    return [session.read_rows(a, z) for a, z in spans]

                try:
                    rows = await self._run(read, tenant=entry.tenant, kind="resize")
                except RowsMoved:
                    raise Abort(Status.ABORTED, f"session {ask.session}: its cache changed mid-transfer") from None
                for j, r in enumerate(rows):
                    yield sent.block(g + j, keys[g + j], scope, r)
        finally:
            cache.unpin(match)

    def _own_blocks(self, ask: Ask, scope: str, start: int) -> tuple[Entry | None, list[bytes], int]:
        """A hand-over's blocks past the prefix cache's: (the session's entry, the chain keys, the
        index past its last full block of ``ask.tokens`` that its cache holds) or (None, [], start)."""
        entry = self.sessions.get((ask.tenant, ask.session))
        if entry is None or entry.scope != scope or not entry.session.prefix_exact:
            return None, [], start
        same = 0
        for a, b in zip(entry.tokens, ask.tokens):
            if a != b:
                break
            same += 1
        end = same // self.prefix.block
        if end <= start:
            return None, [], start
        return entry, self.prefix.keys(scope, ask.tokens, end), end

    async def _serve_hottest(self, ask: Ask):
        """A warm-up's blocks: the most recently used chains (each block after its parent), any scope."""
        cache = self.prefix
        picked = self._hottest(max(0, ask.max_bytes) // cache.block_bytes)
        for b in picked:
            b.pins += 1
        try:
            yield Header(self.fingerprint, len(picked), cache.block_bytes)
            sent = _Sent(self, ask, seed(self.fingerprint, ""), len(picked))
            for i, b in enumerate(picked):
                yield sent.block(i, b.key, b.scope, b.rows, b.tokens, b.parent or b"")
        finally:
            for b in picked:
                b.pins -= 1

    def _hottest(self, most: int) -> list:
        """At most ``most`` ready blocks, most recently used first, each with its whole chain before it."""
        blocks, picked, taken = self.prefix.blocks, [], set()
        for b in reversed(list(blocks.values())):
            path, p, whole = [], b, True
            while p is not None and p.key not in taken:
                if p.rows is None:  # being filled: not sent
                    whole = False
                    break
                path.append(p)
                if p.parent is not None and p.parent not in blocks:  # a stranded tail: not sent
                    whole = False
                    break
                p = None if p.parent is None else blocks[p.parent]
            if whole and len(picked) + len(path) <= most:
                picked.extend(reversed(path))
                taken.update(x.key for x in path)
            if len(picked) >= most:
                break
        return picked

    async def warm(self, address: str) -> tuple[int, int, str]:
        """Fills the prefix cache with the hottest chains of the verifier at ``address`` (a verifier
        that just joined, asked by a gateway): at most ``prefix_warm_share`` of KV memory, free memory
        and ``prefix_fetch_bytes``, reserved before the first byte arrives, within
        ``prefix_fetch_seconds``; every block checked (fingerprint, its key recomputed from its scope,
        parent and tokens, the digest chain) before any is taken. (blocks, bytes taken, why none: a
        refusal's reason, "off", "busy" or "warm"; "" when taken)."""
        cache, mem = self.prefix, self.kv_memory
        if cache is None or not self.fingerprint or self.fetcher is None or self.prefix_warm_share <= 0:
            return 0, 0, "off"
        if self.warming:
            return 0, 0, "busy"
        if self.warmed:
            return 0, 0, "warm"
        budget = min(int(self.prefix_warm_share * mem.total), self.prefix_fetch_bytes, mem.total - mem.used)
        fit = max(0, budget) // cache.block_bytes
        if fit <= 0 or not mem.try_reserve(WARM_KEY, fit * cache.block_bytes):
            self._refused("warm", "budget")
            return 0, 0, "budget"
        ask = Ask("", "", [], 0, cache.block, self.fingerprint, fit * cache.block_bytes, hottest=True)
        seconds, clock, got = self.prefix_fetch_seconds, Clock(), None
        self.warming = True
        try:
            try:
                async with asyncio.timeout(seconds):
                    got = await self._receive_hottest(address, ask, seconds)
            except TimeoutError:
                raise Refused("deadline", f"not done within {seconds:g} s") from None
        except Refused as e:
            self._refused("warm", e.reason)
            log.warning("warm-up refused", extra={"source": address, "reason": e.reason, "detail": e.detail})
            return 0, 0, e.reason
        except Exception as e:  # noqa: BLE001 - a failing holder leaves the cache cold, nothing more
            self._refused("warm", "source")
            log.warning("warm-up failed", extra={"source": address, "error": repr(e)})
            return 0, 0, "source"
        finally:
            self.warming = False
            mem.release(WARM_KEY)
            M.PREFIX_FETCH_SECONDS.observe(clock())
        n = self._take_warm(got)  # no await since the release: the memory is still free
        self.warmed += n
        M.PREFIX_WARMED_ROWS.inc(n * cache.block)
        M.PREFIX_WARMED_BYTES.inc(n * cache.block_bytes)
        log.info("warmed", extra={"source": address, "blocks": n, "seconds": round(clock(), 3)})
        return n, n * cache.block_bytes, ""

    async def _receive_hottest(self, address: str, ask: Ask, seconds: float) -> list[tuple]:
        """A warm-up's blocks from ``address``, each checked before it is taken: (key, parent,
        tokens, scope, rows) in chain order."""
        cache, header, out, total = self.prefix, None, [], 0
        prev, scopes = seed(self.fingerprint, ""), {}  # scopes: key -> scope of the blocks received
        async for item in self.fetcher(address, ask, seconds):
            if header is None:
                header = self._checked_header(item, ask)
                continue
            i = len(out)
            if not isinstance(item, WireBlock) or i >= header.blocks or item.index != i:
                raise Refused("source", f"out of order where block {i} of {header.blocks} was due")
            parent = item.parent or None
            if not item.scope or len(item.tokens) != cache.block:
                raise Refused("scope", f"block {i}: scope {item.scope!r}, {len(item.tokens)} tokens")
            if parent is not None:
                held = cache.blocks.get(parent)
                if scopes.get(parent, held.scope if held is not None else None) != item.scope:
                    raise Refused("scope", f"block {i}'s parent is of another scope, or not sent before it")
            if child_key(cache.scope_key(item.scope), parent, item.tokens) != item.key:
                raise Refused("hash", f"block {i}'s key is not its tokens' in its scope")
            total, prev = _chained(item, i, total, prev, ask.max_bytes)
            out.append((item.key, parent, tuple(item.tokens), item.scope, unpack_rows(item.rows, self.row_layout)))
            scopes[item.key] = item.scope
        if header is None or len(out) < header.blocks:
            raise Refused("source", "the transfer ended early")
        return out

    def _checked_header(self, item, ask: Ask) -> Header:
        if not isinstance(item, Header):
            raise Refused("source", "a block before the header")
        if item.fingerprint != self.fingerprint or item.block_bytes != self.prefix.block_bytes:
            raise Refused("fingerprint", f"the holder's is {item.fingerprint!r}, this one's {self.fingerprint!r}")
        if item.blocks * item.block_bytes > ask.max_bytes:
            raise Refused("budget", f"{item.blocks} blocks announced, {ask.max_bytes} bytes allowed")
        return item

    def _take_warm(self, got: list[tuple]) -> int:
        """A warm-up's checked blocks into the prefix cache (those it lacks, whose parent it holds)."""
        cache = self.prefix
        taken = []
        for key, parent, tokens, scope, rows in got:
            if key in cache.blocks or (parent is not None and parent not in cache.blocks):
                continue
            taken.append(cache.put(key, parent, tokens, scope, rows))
        if not taken:
            return 0
        if not self.kv_memory.try_reserve(PREFIX_KEY, cache.nbytes):  # cannot fail: the warm-up's memory
            cache.discard(taken)
            return 0
        cache.touch(taken)
        M.PREFIX_BYTES.set(cache.nbytes)
        return len(taken)

    def leaving(self, entry: Entry | None) -> None:
        """A drain refused ``entry``'s stream: the session moves, and its hand-over is awaited."""
        cache = self.prefix
        if entry is not None and cache is not None and self.fingerprint and len(entry.tokens) >= cache.block:
            self.moving.add(entry.key)

    async def handed_over(self, seconds: float) -> int:
        """A drain's last wait, after its streams ended: until every moving session has been asked for
        its hand-over and no transfer is being sent, at most ``prefix_fetch_seconds`` for the asks and
        as long again for a transfer in flight (whose receiver gives up at its own deadline), and at
        most ``seconds`` in all. The sessions still awaited."""
        t0 = time.monotonic()
        asks = t0 + min(seconds, self.prefix_fetch_seconds)
        sends = t0 + min(seconds, 2 * self.prefix_fetch_seconds)
        while (self.moving and time.monotonic() < asks) or (self.serving and time.monotonic() < sends):
            await asyncio.sleep(0.02)
        M.PREFIX_HANDOVER_WAIT_SECONDS.set(time.monotonic() - t0)
        left = len(self.moving)
        self.moving.clear()
        return left
