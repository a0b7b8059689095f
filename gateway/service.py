"""The gateway: the public ``Generation`` API over drafter and verifier streams.

Stateless itself: a session's token history lives in the session store (Redis in a deployment), so
any gateway replica can serve any turn. Per turn it opens one stream to the session's drafter
(rendezvous hashing) and one to its verifier (sticky), and runs the rounds: two messages per round.

A turn is all or nothing for the session record: it is saved when the turn ends, so a cancelled or
failed turn leaves the session as it was before (the client may retry it). Drafter and verifier
reconcile their state with the history at every open, whatever happened before.

Faults: a drafter or verifier stream that breaks or stops answering (``backend_timeout``) is
reopened on the next endpoint with the committed tokens; when every endpoint of a kind has failed,
the turn waits up to ``reconnect_seconds`` for one to come back (a restarted pod) before it fails
with UNAVAILABLE. Session-store calls are retried for up to ``store_retry_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass

import grpc

from common.params import MODES
from . import metrics as M
from common.errors import Abort, Status
from common.text import Detokenizer, continue_ids, messages_ids
from common.v1 import drafter_pb2 as dpb
from common.v1 import drafter_pb2_grpc as dgrpc
from common.v1 import generation_pb2 as pb
from common.v1 import generation_pb2_grpc as pb_grpc
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc

from common.loop import Stats, cut, settle
from .auth import tenant_of
from .records import Record, Records
from .routing import Endpoints

log = logging.getLogger("racer.gateway")

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BUDGET = 16  # when the request asks for the adaptive budget but the verifier has no cost curve
ROUND_OVERHEAD_MS = 1.5  # per round outside the verifier's forward: drafter, two RPCs, this loop
# Errors that say the request is wrong, or that the session is busy elsewhere (ABORTED: another
# stream is open on it): failing over would not help, and could run one session twice at once.
_CALLER_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ABORTED,
}
FAILOVERS = 3  # streams lost mid-turn, per service kind and turn (failed opens are bounded by time)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_IDS = 64


@dataclass
class Limits:
    max_prompt_tokens: int = 8192  # tokens of a session's history before a turn generates
    max_new_tokens: int = 2048
    max_budget: int = 256
    max_sessions_per_tenant: int = 32  # turns running at once per tenant, on one gateway (0: no limit)


@dataclass
class Timeouts:
    backend: float = 60.0  # a drafter or verifier message without an answer this long: the stream is lost
    reconnect: float = 15.0  # how long a turn waits for a drafter or verifier when every one has failed
    store_retry: float = 10.0  # how long session-store calls are retried


_END = object()


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


class _Lost(Exception):
    """A drafter or verifier stream broke in a way another replica can repair."""

    def __init__(self, endpoint: str, error: str):
        self.endpoint, self.error = endpoint, error


class _Link:
    """One bidi stream to one endpoint: ``ask`` sends a request and waits for its response."""

    def __init__(self, endpoint: str, call, timeout: float | None = None):
        self.endpoint = endpoint
        self.call = call
        self.timeout = timeout
        self._broken: Exception | None = None  # how the last send failed, for ``receive`` to raise

    async def ask(self, request):
        await self.send(request)
        return await self.receive()

    async def send(self, request) -> None:
        """Sends ``request``; its response is ``receive``'s to read (a failed send shows there)."""
        try:
            async with asyncio.timeout(self.timeout):  # unlike wait_for, no task per call
                await self.call.write(request)
        except asyncio.TimeoutError:
            self._broken = _Lost(self.endpoint, f"could not send in {self.timeout:g} s")
        except grpc.aio.AioRpcError as e:
            self._broken = self._classify(e)
        except asyncio.InvalidStateError:  # the call ended before this write (the server went away)
            self._broken = EOFError()

    async def receive(self):
        broken, self._broken = self._broken, None
        try:
            if isinstance(broken, (_Lost, Abort)):
                raise broken
            async with asyncio.timeout(self.timeout):
                resp = grpc.aio.EOF if broken is not None else await self.call.read()
                if resp is grpc.aio.EOF:
                    code = await self.call.code()
                    raise self._classify(None, code, await self.call.details())
        except asyncio.TimeoutError:
            raise _Lost(self.endpoint, f"no answer in {self.timeout:g} s") from None
        except grpc.aio.AioRpcError as e:
            raise self._classify(e) from None
        return resp

    def _classify(self, e, code=None, details=None):
        code = e.code() if e is not None else code
        details = e.details() if e is not None else details
        if code in _CALLER_ERRORS:
            return Abort(Status[code.name], details or str(code))
        return _Lost(self.endpoint, f"{code}: {details}")

    async def close(self, cancel: bool = False) -> None:
        if cancel:
            self.call.cancel()
            return
        try:
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass


class GatewayService(pb_grpc.GenerationServicer):
    def __init__(self, tokenizer, eos_ids, drafters: Endpoints, verifiers: Endpoints, store,
                 api_keys: dict[str, str] | None = None, limits: Limits = Limits(), ttl: float = 1800.0,
                 vocab_size: int | None = None, timeouts: Timeouts = Timeouts()):
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.drafters = drafters
        self.verifiers = verifiers
        self.records = Records(store, ttl, timeouts.store_retry)
        self.api_keys = api_keys  # None: no auth; a dict (possibly empty: nobody gets in) otherwise
        self.limits = limits
        self.timeouts = timeouts
        self.vocab_size = vocab_size or (len(tokenizer) if tokenizer is not None else None)
        self._turns: dict[tuple[str, str], _Turn] = {}  # (tenant, session id) -> its turn running on this gateway
        self._verifier_load: dict[str, int] = {}
        self.stopping: str | None = None  # set when the gateway drains: why new turns are refused

    async def drain(self, seconds: float) -> None:
        """Refuses new turns; lets running ones finish for ``seconds``, then ends the rest with
        UNAVAILABLE (their sessions stay as they were before the turn)."""
        self.stopping = "the gateway is shutting down; retry on another gateway"
        deadline = time.monotonic() + seconds
        while self._turns and time.monotonic() < deadline - min(1.0, seconds / 2):
            await asyncio.sleep(0.05)
        for turn in list(self._turns.values()):
            turn.abort = ("the gateway is shutting down; this turn was not saved (the session is as it was "
                          "before it): retry it")
        while self._turns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._turns:
            log.warning("turns still running at shutdown", extra={"turns": len(self._turns)})

    def tenant(self, context) -> str:
        return tenant_of(self.api_keys, context.invocation_metadata())

    # -- Generate -----------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context):
        M.ACTIVE_STREAMS.inc()
        code = "OK"
        try:
            tenant = self.tenant(context)
            async for resp in self._generate(tenant, request):
                yield resp
        except Abort as e:
            code = e.code.name
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            M.ACTIVE_STREAMS.dec()
            M.REQUESTS.labels(code).inc()

    def _check_request(self, r: pb.GenerateRequest):
        from common.params import SamplingParams

        lim = self.limits
        max_new = r.max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, lim.max_new_tokens)  # 0: the default, within the limit
        if not 1 <= max_new <= lim.max_new_tokens:
            raise Abort(Status.INVALID_ARGUMENT, f"max_new_tokens: {r.max_new_tokens}, expected 1..{lim.max_new_tokens}")
        mode = r.speculation.mode or "racer"
        if mode not in MODES:
            raise Abort(Status.INVALID_ARGUMENT, f"speculation.mode: {mode!r}, expected one of {', '.join(MODES)}")
        budget = r.speculation.budget  # 0: adaptive
        if not 0 <= budget <= lim.max_budget:
            raise Abort(Status.INVALID_ARGUMENT, f"speculation.budget: {r.speculation.budget}, expected 0 (adaptive) or 1..{lim.max_budget}")
        try:
            SamplingParams(r.temperature, r.top_p or 1.0, r.top_k, r.seed if r.HasField("seed") else None)
        except ValueError as e:
            raise Abort(Status.INVALID_ARGUMENT, str(e)) from None
        if len(r.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in r.stop):
            raise Abort(Status.INVALID_ARGUMENT,
                        f"stop: at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
        if any(s == "" for s in r.stop):
            raise Abort(Status.INVALID_ARGUMENT, "stop: empty stop string")
        if len(r.stop_ids) > MAX_STOP_IDS:
            raise Abort(Status.INVALID_ARGUMENT, f"stop_ids: {len(r.stop_ids)} ids, at most {MAX_STOP_IDS}")
        if any(t < 0 or (self.vocab_size and t >= self.vocab_size) for t in r.stop_ids):
            raise Abort(Status.INVALID_ARGUMENT, "stop_ids: token id outside the vocabulary")
        if r.system and r.WhichOneof("input") != "prompt":
            raise Abort(Status.INVALID_ARGUMENT, "system: only with a prompt input (chat carries its own)")
        return max_new, mode, budget

    def _turn_ids(self, r: pb.GenerateRequest, history: list[int]) -> list[int]:
        kind = r.WhichOneof("input")
        if kind is None:
            raise Abort(Status.INVALID_ARGUMENT, "input: set one of prompt, chat, prompt_ids")
        if kind == "prompt_ids":
            ids = list(r.prompt_ids.ids)
            if not ids:
                raise Abort(Status.INVALID_ARGUMENT, "prompt_ids: empty")
            bad = next((t for t in ids if t < 0 or (self.vocab_size and t >= self.vocab_size)), None)
            if bad is not None:
                raise Abort(Status.INVALID_ARGUMENT, f"prompt_ids: token id {bad} outside the vocabulary [0, {self.vocab_size})")
            return ids
        if self.tokenizer is None:
            raise Abort(Status.FAILED_PRECONDITION, f"{kind}: this gateway has no tokenizer; send prompt_ids")
        if kind == "prompt":
            if not r.prompt:
                raise Abort(Status.INVALID_ARGUMENT, "prompt: empty")
            messages = [{"role": "user", "content": r.prompt}]
            if r.system and not history:
                messages.insert(0, {"role": "system", "content": r.system})
        else:
            messages = [{"role": m.role, "content": m.content} for m in r.chat.messages]
            if not messages:
                raise Abort(Status.INVALID_ARGUMENT, "chat.messages: empty")
            bad = next((m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")), None)
            if bad is not None:
                raise Abort(Status.INVALID_ARGUMENT, f"chat.messages.role: {bad!r}, expected system, user or assistant")
        # Text longer than this cannot fit the token limit (a token is at least one character for the
        # tokenizers this serves; checked before tokenizing a huge string).
        chars = len(r.prompt) + len(r.system) + sum(len(m.content) for m in r.chat.messages)
        if chars > 64 * self.limits.max_prompt_tokens:
            raise Abort(Status.INVALID_ARGUMENT,
                        f"{kind}: {chars} characters, more than max_prompt_tokens={self.limits.max_prompt_tokens} tokens "
                        "can hold (refused before tokenizing)")
        try:
            return continue_ids(self.tokenizer, history, messages, self.eos_ids) if history else messages_ids(self.tokenizer, messages)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise Abort(Status.INVALID_ARGUMENT, f"{kind}: the chat template rejected it: {e}") from None

    async def _generate(self, tenant: str, r: pb.GenerateRequest):
        if self.stopping:
            raise Abort(Status.UNAVAILABLE, self.stopping)
        max_new, mode, budget = self._check_request(r)
        if r.session_id:
            record = await self.records.load(tenant, r.session_id)
        else:
            record = Record(secrets.token_urlsafe(18), tenant)
        key = (tenant, record.session_id)
        if key in self._turns:
            raise Abort(Status.ABORTED, f"session_id {record.session_id!r}: a turn is already running")
        lim = self.limits
        running = sum(1 for t, _ in self._turns if t == tenant)
        if lim.max_sessions_per_tenant and running >= lim.max_sessions_per_tenant:
            raise Abort(Status.RESOURCE_EXHAUSTED,
                        f"tenant {tenant!r}: {running} sessions are generating, the limit is "
                        f"max_sessions_per_tenant={lim.max_sessions_per_tenant}; retry when one ends")
        turn = self._turn_ids(r, record.history)
        kind = r.WhichOneof("input")
        if len(turn) > lim.max_prompt_tokens:
            raise Abort(Status.INVALID_ARGUMENT,
                        f"{kind}: {len(turn)} tokens, the limit is max_prompt_tokens={lim.max_prompt_tokens}")
        history = record.history + turn
        if len(history) > lim.max_prompt_tokens:
            raise Abort(Status.FAILED_PRECONDITION,
                        f"session_id {record.session_id!r}: the session holds {len(record.history)} tokens, with this "
                        f"turn's {len(turn)} it would exceed max_prompt_tokens={lim.max_prompt_tokens}; start a new session")
        run = self._turns[key] = _Turn(self, record, history, len(turn), r, max_new, mode, budget)
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
            del self._turns[key]

    # -- sessions -----------------------------------------------------------------------------
    async def _info(self, rec: Record, closed: bool = False) -> pb.SessionInfo:
        ranked = self.drafters.ranked(rec.session_id)
        return pb.SessionInfo(
            session_id=rec.session_id, turns=rec.turns, tokens=len(rec.history), drafter=ranked[0] if ranked else "",
            verifier=rec.verifier, created_unix=rec.created, last_used_unix=rec.last_used, closed=closed,
        )

    async def GetSession(self, request, context):
        rec = await self.records.load(self.tenant(context), request.session_id)
        return await self._info(rec)

    async def CloseSession(self, request, context):
        tenant = self.tenant(context)
        rec = await self.records.load(tenant, request.session_id)
        if (tenant, rec.session_id) in self._turns:
            raise Abort(Status.FAILED_PRECONDITION, f"session_id {rec.session_id!r}: a turn is running")
        await self.records.delete(rec)
        await self._drop_everywhere(tenant, rec)
        return await self._info(rec, closed=True)

    async def _drop_everywhere(self, tenant: str, rec: Record) -> None:
        """Best effort: every drafter (any may hold a copy after a failover) and the verifier."""
        calls = [dgrpc.DrafterStub(self.drafters.channel(ep)).Drop(dpb.DropRequest(session_id=rec.session_id, tenant=tenant), timeout=5)
                 for ep in self.drafters.endpoints]
        if rec.verifier:
            calls.append(vgrpc.VerifierStub(self.verifiers.channel(rec.verifier)).Drop(
                vpb.VerifierDropRequest(session_id=rec.session_id, tenant=tenant), timeout=5))
        for res in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(res, Exception):
                log.warning("drop failed", extra={"session_id": rec.session_id, "error": repr(res)})

    async def ListSessions(self, request, context):
        tenant = self.tenant(context)
        out = [await self._info(rec) for rec in await self.records.all(tenant)]
        return pb.ListSessionsResponse(sessions=sorted(out, key=lambda s: s.created_unix))


class _Turn:
    """One turn of one session: opens the streams, runs the rounds, fails over, saves the record."""

    def __init__(self, gw: GatewayService, record: Record, history: list[int], n_turn: int, r: pb.GenerateRequest,
                 max_new: int, mode: str, budget: int):
        self.gw = gw
        self.record = record
        self.history = history
        self.n_turn = n_turn
        self.r = r
        self.max_new = max_new
        self.mode = mode
        self.budget = budget
        self.stop_ids = set(gw.eos_ids) | set(r.stop_ids)
        self.sampling = vpb.Sampling(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        if r.HasField("seed"):
            self.sampling.seed = r.seed
        self.stats = Stats()
        self.draft_ms = 0.0
        self.verify_ms = 0.0
        self.prefill_ms = 0.0
        self.drafter: _Link | None = None
        self.verifier: _Link | None = None
        self.cost = None  # the verifier's cost curve (adaptive budget)
        self.failed: dict[str, set[str]] = {"drafter": set(), "verifier": set()}  # not tried again this turn
        self.full: set[str] = set()  # verifiers that refused the session for lack of room
        self.lost = {"drafter": 0, "verifier": 0}  # streams lost mid-turn
        self.last_error = {"drafter": "", "verifier": ""}
        self.abort: str | None = None  # set by a draining gateway: end the turn with UNAVAILABLE
        self.waiting: dict[str, float] = {}  # kind -> when to stop waiting for one to come back

    def _check_abort(self) -> None:
        if self.abort:
            raise Abort(Status.UNAVAILABLE, self.abort)

    # -- links --------------------------------------------------------------------------------
    async def _candidates(self, kind: str) -> list[str]:
        """Endpoints of ``kind`` to try, best first. When every one has failed this turn, waits with
        backoff (at most ``reconnect`` seconds in all) and tries them all again: a restarted pod, a
        Redis-backed drafter coming back, a DNS change."""
        gw = self.gw
        eps = gw.drafters if kind == "drafter" else gw.verifiers
        delay = 0.05
        while True:
            self._check_abort()
            await eps.refresh()
            if kind == "drafter":
                ranked = eps.ranked(self.record.session_id, exclude=self.failed[kind])
            else:
                live = [e for e in eps.live() if e not in self.failed[kind] and e not in self.full]
                sticky = self.record.verifier
                ranked = sorted(live, key=lambda e: (e != sticky, gw._verifier_load.get(e, 0)))
            if ranked:
                return ranked
            if kind == "verifier" and self.full and not self.failed[kind]:
                raise Abort(Status.RESOURCE_EXHAUSTED, f"every verifier is full: {self.last_error[kind]}")
            now = time.monotonic()
            deadline = self.waiting.get(kind)
            if deadline is None:  # kept until an open succeeds: the retries below do not restart the clock
                deadline = self.waiting[kind] = now + gw.timeouts.reconnect
                log.warning(f"no {kind} reachable; waiting for one", extra={"session_id": self.record.session_id,
                                                                             "seconds": gw.timeouts.reconnect})
            if now + delay > deadline:
                raise Abort(Status.UNAVAILABLE,
                            f"no {kind} reachable for {gw.timeouts.reconnect:g} s (last error: {self.last_error[kind]}); "
                            "the turn was not saved: retry it")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            self.failed[kind].clear()
            await eps.refresh(force=True)

    async def _open_verifier(self, ctx: list[int]) -> vpb.VerifyResponse:
        gw = self.gw
        while True:
            ep = (await self._candidates("verifier"))[0]
            call = vgrpc.VerifierStub(gw.verifiers.channel(ep)).Session()
            link = _Link(ep, call, gw.timeouts.backend)
            try:
                resp = await link.ask(vpb.VerifyRequest(open=vpb.VerifierOpen(
                    session_id=self.record.session_id, tenant=self.record.tenant, history=ctx, sampling=self.sampling)))
            except (_Lost, Abort) as e:
                await link.close(cancel=True)
                if isinstance(e, Abort) and e.code == Status.RESOURCE_EXHAUSTED:
                    self.full.add(ep)  # that verifier has no room: another may
                    self.last_error["verifier"] = f"{ep}: {e.message}"
                    continue
                if isinstance(e, Abort):
                    raise
                self._unreachable("verifier", e)
                continue
            self.verifier = link
            self.waiting.pop("verifier", None)
            if self.record.verifier and self.record.verifier != ep:
                log.info("session moved to another verifier", extra={"session_id": self.record.session_id,
                                                                      "from": self.record.verifier, "to": ep})
            self.record.verifier = ep
            if resp.cost.sizes:
                self.cost = resp.cost
            gw._verifier_load[ep] = gw._verifier_load.get(ep, 0) + 1
            self.prefill_ms += resp.elapsed_ms
            return resp

    async def _open_drafter(self, ctx: list[int], topk: list[int], width: int) -> None:
        adaptive = self.budget == 0 and self.cost is not None and len(self.cost.sizes) > 0
        gw = self.gw
        while True:
            ep = (await self._candidates("drafter"))[0]
            link = _Link(ep, dgrpc.DrafterStub(gw.drafters.channel(ep)).Session(), gw.timeouts.backend)
            try:
                resp = await link.ask(dpb.DraftRequest(open=dpb.DrafterOpen(
                    session_id=self.record.session_id, tenant=self.record.tenant, history=ctx,
                    history_topk=topk, topk=width, cost=self.cost if adaptive else None,
                    overhead_ms=ROUND_OVERHEAD_MS)))
            except (_Lost, Abort) as e:
                await link.close(cancel=True)
                if isinstance(e, Abort):
                    raise
                self._unreachable("drafter", e)
                continue
            self.drafter = link
            self.waiting.pop("drafter", None)
            self.draft_ms += resp.elapsed_ms
            if self.budget == 0 and not adaptive:
                self.budget = DEFAULT_BUDGET
            log.debug("drafter open", extra={"session_id": self.record.session_id, "drafter": ep, "restored_from": resp.restored_from})
            return

    def _unreachable(self, kind: str, e: _Lost) -> None:
        """An open failed: try the next endpoint (``_candidates`` bounds the retries by time)."""
        log.warning(f"{kind} unreachable", extra={"session_id": self.record.session_id, "endpoint": e.endpoint, "error": e.error})
        self._exclude(kind, e)

    def _exclude(self, kind: str, e: _Lost) -> None:
        """Not tried again this turn; every turn skips it for a while (``Endpoints.mark_down``)."""
        self.failed[kind].add(e.endpoint)
        self.last_error[kind] = f"{e.endpoint}: {e.error}"
        (self.gw.drafters if kind == "drafter" else self.gw.verifiers).mark_down(e.endpoint)

    def _lost(self, kind: str, e: _Lost) -> None:
        """A stream broke mid-turn: fail over (a few times per turn at most)."""
        self._check_abort()
        log.warning(f"{kind} lost; failing over", extra={"session_id": self.record.session_id, "endpoint": e.endpoint, "error": e.error})
        M.FAILOVERS.labels(kind).inc()
        self._exclude(kind, e)
        self.lost[kind] += 1
        if self.lost[kind] > FAILOVERS:
            raise Abort(Status.UNAVAILABLE, f"{kind}s keep failing ({self.lost[kind]} streams lost this turn; "
                                                     f"last: {e.error}); the turn was not saved: retry it")

    async def _release(self, cancel: bool) -> None:
        for link in (self.drafter, self.verifier):
            if link is not None:
                await link.close(cancel=cancel)
        if self.verifier is not None:
            self.gw._verifier_load[self.verifier.endpoint] -= 1
        self.drafter = self.verifier = None

    # -- rounds -------------------------------------------------------------------------------
    async def stream(self):
        t0 = time.perf_counter()
        sid = self.record.session_id
        detok = Detokenizer(self.gw.tokenizer) if self.gw.tokenizer is not None else None
        emitted: list[int] = []
        finished = False
        try:
            ctx = list(self.history)  # committed in drafter and verifier: history + emitted, minus the last
            opened = await self._open_verifier(ctx)
            await self._open_drafter(ctx, list(opened.topk), opened.topk_width)
            root = opened.next_token
            out, done = cut([root], self.stop_ids, self.max_new)
            feedback: tuple[list[int], list[int], int, int] = ([], [], 0, 0)
            sent = False  # the next step is already on its way to the drafter
            while True:
                out, done, text = self._stop_strings(detok, emitted, out, done)
                if out:
                    if not emitted:
                        M.TTFT_MS.observe((time.perf_counter() - t0) * 1e3)
                    emitted.extend(out)
                    self.stats.new_tokens += len(out)
                    M.GENERATED_TOKENS.inc(len(out))
                    yield pb.GenerateResponse(session_id=sid, text=text, token_ids=out)
                if done:
                    break
                self._check_abort()
                t_round = time.perf_counter()
                tree = await self._draft(ctx, root, feedback, sent)
                res = await self._verify(ctx, root, tree)
                path = [tree.tokens[i] for i in res.accepted]
                out, fed, done = settle(path, res.next_token, self.stop_ids, self.max_new - self.stats.new_tokens)
                ctx.extend(fed)
                feedback = (list(res.topk), list(res.accepted), len(fed), res.batch_rows)
                root = out[-1] if out else res.next_token
                # The next step goes out before this round's bookkeeping and text, which are then done
                # while the drafter works. Not with stop strings: the text may still end the turn, and
                # the drafter would have committed tokens past the cut.
                sent = not done and not self.r.stop and self.drafter is not None
                if sent:
                    await self.drafter.send(dpb.DraftRequest(step=self._step(root, feedback)))
                self._count(tree, res)
                M.ROUND_MS.observe((time.perf_counter() - t_round) * 1e3)
            finished = True
            yield await self._finish(emitted, t0)
        finally:
            await self._release(cancel=not finished)

    def _stop_strings(self, detok, emitted, out, done):
        """Text of ``out``; cut after the token that completes a stop string (which ends the turn)."""
        if detok is None:
            return out, done, ""
        stops = self.r.stop
        text = ""
        for i, tok in enumerate(out):
            before = len(detok.text)
            text += detok.push([tok])
            if stops and any(s in detok.text[max(0, before - max(map(len, stops))):] for s in stops):
                return out[: i + 1], True, text
        return out, done, text

    def _step(self, root, feedback) -> dpb.DraftStep:
        topk, accepted, commit, batch_rows = feedback
        return dpb.DraftStep(tree_topk=topk, accepted=accepted, commit=commit, root=root, budget=self.budget,
                             mode=self.mode, batch_rows=batch_rows)

    async def _draft(self, ctx, root, feedback, sent: bool = False):
        """The next tree; ``sent``: its step is already on its way (only its response is read)."""
        step = None if sent else self._step(root, feedback)
        while True:
            if self.drafter is None:
                await self._open_drafter(ctx, [], 0)
                step = self._step(root, ([], [], 0, feedback[3]))  # a fresh stream has no tree to learn from
                sent = False
            try:
                if not sent:
                    await self.drafter.send(dpb.DraftRequest(step=step))
                sent = False
                resp = await self.drafter.receive()
            except _Lost as e:
                await self.drafter.close(cancel=True)
                self.drafter = None
                self._lost("drafter", e)
                continue
            except Abort as e:  # the request was checked at the door: a refused step is our bug, not the caller's
                raise Abort(Status.INTERNAL, f"drafter {self.drafter.endpoint} refused a step: {e.code.name}: {e.message}") from None
            self.draft_ms += resp.elapsed_ms
            if not resp.tree.tokens or resp.tree.tokens[0] != root:
                raise Abort(Status.INTERNAL, f"drafter {self.drafter.endpoint} returned a tree with the wrong root")
            return resp.tree

    async def _verify(self, ctx, root, tree):
        while True:
            if self.verifier is None:
                await self._open_verifier(ctx)  # its next token is ``root`` again (greedy) or a discarded draw
            try:
                resp = await self.verifier.ask(vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=tree.tokens, parents=tree.parents)))
            except Abort as e:
                raise Abort(Status.INTERNAL, f"verifier {self.verifier.endpoint} refused a draft tree: {e.code.name}: {e.message}") from None
            except _Lost as e:
                await self.verifier.close(cancel=True)
                self.gw._verifier_load[self.verifier.endpoint] -= 1
                self.verifier = None
                self._lost("verifier", e)
                continue
            self.verify_ms += resp.elapsed_ms
            return resp

    def _count(self, tree, res) -> None:
        self.stats.count_round(len(tree.tokens), len(res.accepted))
        M.NUM_DRAFTS.labels(self.mode).inc()
        M.NUM_DRAFT_TOKENS.labels(self.mode).inc(len(tree.tokens) - 1)
        M.NUM_ACCEPTED_TOKENS.labels(self.mode).inc(len(res.accepted) - 1)
        for pos in range(1, len(res.accepted)):
            M.ACCEPTED_PER_POS.labels(str(pos)).inc()

    async def _finish(self, emitted: list[int], t0: float) -> pb.GenerateResponse:
        rec = self.record
        try:
            await self.drafter.ask(dpb.DraftRequest(end_turn=dpb.EndTurn()))
        except (_Lost, Abort) as e:  # the snapshot is an optimisation; the turn is done
            log.warning("end_turn failed", extra={"session_id": rec.session_id, "error": getattr(e, "error", repr(e))})
        rec.history = self.history + emitted
        rec.turns += 1
        rec.last_used = time.time()
        try:
            await self.gw.records.save(rec)
        except Abort as e:
            raise Abort(e.code, f"{e.message}; the turn was not saved: retry it") from None
        total = time.perf_counter() - t0
        s = self.stats
        last = emitted[-1] if emitted else None
        stop_hit = last in self.stop_ids or (s.new_tokens < self.max_new)
        return pb.GenerateResponse(
            session_id=rec.session_id,
            finish_reason="stop" if stop_hit else "length",
            usage=pb.Usage(prompt_tokens=self.n_turn, completion_tokens=s.new_tokens, session_tokens=len(rec.history)),
            stats=pb.SpeculationStats(
                rounds=s.rounds, drafted=s.drafted, accepted=s.accepted, mat=s.mat, prefill_ms=self.prefill_ms,
                draft_ms=self.draft_ms, verify_ms=self.verify_ms, total_ms=total * 1e3,
                tokens_per_second=s.new_tokens / total if total else 0.0,
            ),
        )
