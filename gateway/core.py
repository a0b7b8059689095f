"""The gateway: the public ``Generation`` API over drafter and verifier streams, without protobuf.

Stateless itself: a session's token history lives in the session store (Redis in a deployment), so
any gateway replica can serve any turn. Per turn it opens one stream to the session's drafter
(rendezvous hashing) and one to its verifier (sticky), and runs the rounds: two messages per round
(a drafter step and a tree), rounds without a tree asked of the verifier as runs.
A stream that breaks is reopened elsewhere (``turn_links``); session-store calls are retried (``records``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterable

from common.errors import Abort, Status

from .admission import Queued, Queueing, TurnQueue, TurnsFull
from .auth import ApiKeys, tenant_of
from .leases import Lease, break_lease, lease_key
from .links import Backends
from .quotas import Quotas, TenantLimits
from .records import Record, Records
from .requests import Limits, Request, check, input_ids
from .routing import Endpoints
from .tools import template_for
from .turn import Chunk, Finished, Turn
from .turn_links import PLAIN_OVERHEAD_MS, RoundOverhead

log = logging.getLogger("racer.gateway")


@dataclass
class Timeouts:
    backend: float = 60.0  # a drafter or verifier message without an answer this long: the stream is lost
    reconnect: float = 15.0  # how long a turn waits for a drafter or verifier when every one has failed
    store_retry: float = 10.0  # how long session-store calls are retried


_END = object()


def _running(session_id: str) -> Abort:
    return Abort(Status.ABORTED, f"session_id {session_id!r}: a turn is already running", field="session_id")


async def _pump(responses, queue: asyncio.Queue) -> None:
    """Moves an async generator's items (then ``_END``, or the exception that ended it) into ``queue``."""
    try:
        async with contextlib.aclosing(responses):
            async for item in responses:
                queue.put_nowait(item)
    except BaseException as e:  # noqa: BLE001 - the consumer re-raises it (or, cancelled, drops it)
        queue.put_nowait(e)
    else:
        queue.put_nowait(_END)


class Gateway:
    def __init__(
        self,
        *,
        tokenizer,
        eos_ids,
        drafters: Endpoints,
        verifiers: Endpoints,
        store,
        api_keys: ApiKeys | None = None,
        limits: Limits = Limits(),
        ttl: float = 1800.0,
        vocab_size: int | None = None,
        timeouts: Timeouts = Timeouts(),
        tenant_limits: TenantLimits = TenantLimits(),
        lease_s: float = 10.0,
        queueing: Queueing = Queueing(),
        chat_template: str = "",
        tool_parser: str = "hermes",
        runs: bool = True,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # the operator's template text ("": the model's own)
        self.tool_parser = tool_parser  # how tool calls are read out of the text (gateway.tools.PARSERS)
        self.runs = runs  # rounds without a tree go to the verifier as runs (VerifyTree.run)
        self._grammars = None  # gateway.grammar.Grammars, made at the first constrained request
        self.eos_ids = tuple(eos_ids)
        self.backends = Backends(drafters, verifiers, timeouts.backend)
        self.api_keys = api_keys  # None: no auth; keys (possibly none: nobody gets in) otherwise
        self.limits = limits
        self.timeouts = timeouts
        self.vocab_size = vocab_size or (len(tokenizer) if tokenizer is not None else None)
        self.records = Records(store, ttl, timeouts.store_retry, self.vocab_size)
        self.quotas = Quotas(store, tenant_limits, ttl, self.records.call)  # in the store: shared by replicas
        self.lease_s = lease_s  # a turn's lease on its session: renewed every third of this while it runs
        self.queue = TurnQueue(queueing, store)  # turns waiting for a slot of their tenant
        # measured on this gateway's rounds with and without the drafter, for the adaptive budget
        self.round_overhead = RoundOverhead()
        self.plain_overhead = RoundOverhead(PLAIN_OVERHEAD_MS, "plain")
        self._turns: dict[tuple[str, str], Turn] = {}  # (tenant, session id) -> its turn running on this gateway
        self.stopping: str | None = None  # set when the gateway drains: why new turns are refused

    def tenant(self, metadata: Iterable[tuple[str, str]] | None) -> str:
        return tenant_of(self.api_keys, metadata)

    async def drain(self, seconds: float) -> None:
        """Refuses new turns; lets running ones finish for ``seconds``, then ends the rest with
        UNAVAILABLE (their sessions stay as they were before the turn)."""
        self.stopping = "the gateway is shutting down; retry on another gateway"
        self.queue.stop(self.stopping)
        deadline = time.monotonic() + seconds
        while self._turns and time.monotonic() < deadline - min(1.0, seconds / 2):
            await asyncio.sleep(0.05)
        for turn in list(self._turns.values()):
            turn.stop(
                "the gateway is shutting down; this turn was not saved (the session is as it was before it): retry it"
            )
        while self._turns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._turns:
            log.warning("turns still running at shutdown", extra={"turns": len(self._turns)})

    async def generate(
        self, tenant: str, r: Request, deadline_s: float | None = None
    ) -> AsyncIterator[Queued | Chunk | Finished]:
        """One turn: checks, admits and runs it. ``Queued`` while it waits for a slot of its tenant
        (``admission``: at once, then every few seconds), then ``Chunk`` messages, then one
        ``Finished``. ``deadline_s``: how long the client still waits, if it said (a wait ends sooner)."""
        if self.stopping:
            raise Abort(Status.UNAVAILABLE, self.stopping)
        req = check(r, self.limits, self.vocab_size)
        constraint = None
        if req.grammar is not None:  # compiled before the turn takes anything: a refused schema is a 400
            constraint = await asyncio.to_thread(self._constraint, req.grammar)
        if r.session_id:
            record = await self.records.load(tenant, r.session_id)
            if r.expect_tokens >= 0 and len(record.history) != r.expect_tokens:
                raise Abort(
                    Status.ABORTED,
                    f"session_id {r.session_id!r}: the session holds {len(record.history)} tokens, not the "
                    f"{r.expect_tokens} this turn continues",
                    field="session_id",
                )
        else:
            record = Record.new(secrets.token_urlsafe(18), tenant)
        key = (tenant, record.session_id)
        if key in self._turns:
            raise _running(record.session_id)
        turn = await self._input_ids(r, record.history)
        history = record.history + turn
        if len(history) > self.limits.max_prompt_tokens:
            raise Abort(
                Status.FAILED_PRECONDITION,
                f"session_id {record.session_id!r}: the session holds {len(record.history)} tokens, with this "
                f"turn's {len(turn)} it would exceed max_prompt_tokens={self.limits.max_prompt_tokens}; "
                "start a new session",
                field="session_id",
            )
        kept = len(record.history)  # what the session holds if this turn is not saved

        def attempt():
            return self._take_lease(key, len(history) + req.max_new, not r.session_id, kept, r.keep)

        async with contextlib.aclosing(self.queue.enter(tenant, record.session_id, attempt, deadline_s)) as admission:
            async for item in admission:
                if isinstance(item, Queued):
                    yield item
                else:
                    lease = item
        # Listed at once (no await since the lease was taken): the drain waits for it, and _run settles it.
        run = self._turns[key] = Turn(self, record, history, len(turn), req)
        run.constrain(constraint)
        async with contextlib.aclosing(self._run(key, run, lease, kept)) as items:
            async for item in items:
                yield item

    async def _take_lease(self, key: tuple[str, str], need: int, new: bool, kept: int, keep: bool = True) -> Lease:
        """The turn's lease and its place in the quotas (``need`` tokens; ``keep`` False: a one-call
        session, never counted as kept); ``TurnsFull`` while the tenant's turns are."""
        tenant, sid = key
        if key in self._turns:
            raise _running(sid)
        cap = self.limits.max_sessions_per_tenant
        running = sum(1 for t, _ in self._turns if t == tenant)
        if cap and running >= cap:
            raise TurnsFull(
                f"tenant {tenant!r}: {running} sessions are generating on this gateway, the limit is "
                f"max_sessions_per_tenant={cap}",
                cap,
            )
        lease = Lease(self.records, self.quotas, tenant, sid, self.lease_s)
        await lease.take(need, new=new, kept=keep)  # ABORTED if a turn runs anywhere
        if key in self._turns:  # a turn of this gateway whose lease expired: never overwrite it
            await lease.end(None, kept)
            raise _running(sid)
        return lease

    async def _run(self, key: tuple[str, str], run: Turn, lease: Lease, kept: int) -> AsyncIterator[Chunk | Finished]:
        """The admitted turn's messages; however it ends, its lease and quotas are settled after."""
        t_start = time.monotonic()
        run.lease = lease
        lease.keep(lambda reason: run.stop(reason, Status.ABORTED, "session_id"))
        # The rounds run in their own task and hand their responses over through a queue: a
        # streamed message's send completes ~0.4 ms after it is queued, and the next round need
        # not wait for it. The queue holds at most one turn's tokens.
        queue: asyncio.Queue = asyncio.Queue()
        rounds = asyncio.create_task(_pump(run.stream(), queue))
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not rounds.done():
                rounds.cancel()  # the client went away: the turn releases its drafter and verifier
            await asyncio.gather(rounds, return_exceptions=True)
            # Shielded: a second cancel (the server stopping after the drain) does not cut the quota
            # update and the lease release short, and the turn stays listed (the drain waits) until done.
            await asyncio.shield(asyncio.ensure_future(self._ended(key, lease, run.saved_tokens, kept, t_start)))

    async def _ended(self, key: tuple[str, str], lease: Lease, saved: int | None, kept: int, t_start: float) -> None:
        """Settles the ended turn's lease and quotas, then hands its slot to a waiting turn of the tenant."""
        try:
            await lease.end(saved, kept)
        finally:
            self._turns.pop(key, None)
        await self.queue.ended(key[0], time.monotonic() - t_start)

    async def _input_ids(self, r: Request, history: list[int]) -> list[int]:
        """The turn's input tokens: text is tokenized, and a large ``prompt_ids`` scanned, off the event
        loop, so one large request does not hold up every other stream of this gateway."""
        template = None
        if r.input in ("chat", "prompt"):  # through a chat template (INVALID_ARGUMENT if there is none)
            wants_tools = bool(r.tools) or any(r.chat_extra)
            template = template_for(self.tokenizer, self.chat_template, wants_tools, r.input)
        args = (r, history, self.tokenizer, self.eos_ids, self.limits, self.vocab_size, template)
        if r.input == "prompt_ids" and len(r.prompt_ids) <= 2048:
            return input_ids(*args)
        return await asyncio.to_thread(input_ids, *args)

    def _constraint(self, spec):
        if self.tokenizer is None:
            raise Abort(Status.FAILED_PRECONDITION, f"{spec.field}: this gateway has no tokenizer", field=spec.field)
        if self._grammars is None:
            from .grammar import Grammars  # the grammar library loads only when a request needs it

            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars.constraint(spec)

    # -- sessions -----------------------------------------------------------------------------
    async def session(self, tenant: str, session_id: str) -> Record:
        return await self.records.load(tenant, session_id)

    async def close(self, tenant: str, session_id: str) -> Record:
        """Ends a turn of the session running on any gateway (ABORTED, not saved), deletes the record,
        then drops the session's state in the backends (best effort). A
        corrupt record is deleted too (its verifier unknown: the verifier's copy expires on its own)."""
        try:
            rec = await self.records.load(tenant, session_id)
        except Abort as e:
            # corrupt, or a new session whose first turn runs now (its lease is there, its record not yet)
            if e.code is not Status.DATA_LOSS and not (
                e.code is Status.NOT_FOUND and await self._leased(tenant, session_id)
            ):
                raise
            rec = Record.new(session_id, tenant, at=0.0)
        # A turn of the session running on any gateway loses its lease: it ends with ABORTED and its
        # fenced save cannot bring the record back.
        await break_lease(self.records, tenant, rec.session_id)
        run = self._turns.get((tenant, rec.session_id))
        if run is not None:
            closed = f"session_id {rec.session_id!r}: the session was closed while this turn ran"
            run.stop(closed, Status.ABORTED, "session_id")
        await self.records.delete(rec)
        await self.quotas.forget(tenant, rec.session_id)
        await self.backends.drop(rec.session_id, tenant, rec.verifier)
        return rec

    async def _leased(self, tenant: str, session_id: str) -> bool:
        return await self.records.call("get", self.records.store.get, lease_key(tenant, session_id)) is not None

    async def sessions(self, tenant: str) -> list[Record]:
        """The tenant's sessions, oldest first."""
        return sorted(await self.records.all(tenant), key=lambda rec: rec.created)
