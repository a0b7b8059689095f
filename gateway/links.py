"""The gateway's gRPC side towards the backends: one bidi stream per drafter or verifier a turn uses.

Protobuf stops here: the links take and return plain values, and say how a stream failed with
``Lost`` (another replica can repair it) or ``Abort`` (it would fail there too).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import grpc

from common import tracing
from common.errors import DRAINING, Abort, Status
from common.prefix import chain_keys, key_id
from common.v1 import common_pb2 as cpb
from common.v1 import drafter_pb2 as dpb
from common.v1 import drafter_pb2_grpc as dgrpc
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc

from . import metrics as M
from .routing import Endpoints

log = logging.getLogger("racer.gateway")

# Errors that say the request is wrong, or that the session is busy elsewhere (ABORTED: another
# stream is open on it): failing over would not help, and could run one session twice at once.
_CALLER_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED,
}
# A backend that refuses the gateway's credential (internal token, client certificate): the
# deployment is misconfigured, not the caller's request, and every replica would refuse the same.
_REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


class Cost(NamedTuple):
    """A verifier's cost curve as its open sent it, passed on to the drafter as it came."""

    sizes: tuple[int, ...]  # tree sizes
    ms: tuple[float, ...]  # forward ms at each, over ``context`` tokens
    context: int = 0
    ms_per_token: tuple[float, ...] = ()  # what each token of context adds, per size (empty: not measured)


class Lost(Exception):
    """A drafter or verifier stream broke in a way another replica can repair. ``draining``: the
    backend is shutting down and ended the stream on purpose (the session moves; nothing failed)."""

    def __init__(self, endpoint: str, error: str, draining: bool = False):
        self.endpoint, self.error, self.draining = endpoint, error, draining


@dataclass(frozen=True)
class LogProbs:
    """Of chosen tokens, in order: each one's log-probability and the top ``n`` (ids, values)."""

    chosen: list[float]
    top_ids: list[list[int]]
    top: list[list[float]]


def _logprobs(resp) -> LogProbs | None:
    if not resp.logprobs:
        return None
    k = len(resp.logprobs)
    n = len(resp.top_ids) // k
    ids, vals = list(resp.top_ids), list(resp.top_logprobs)
    return LogProbs(
        list(resp.logprobs), [ids[i * n : (i + 1) * n] for i in range(k)], [vals[i * n : (i + 1) * n] for i in range(k)]
    )


def _echo(resp) -> LogProbs:
    values = [None if math.isnan(v) else v for v in resp.echo_logprobs]
    have = sum(v is not None for v in values)
    n = len(resp.echo_top_ids) // have if have else 0
    ids, vals = list(resp.echo_top_ids), list(resp.echo_top_logprobs)
    top_ids, top, i = [], [], 0
    for v in values:
        k = 0 if v is None else n
        top_ids.append(ids[i : i + k])
        top.append(vals[i : i + k])
        i += k
    return LogProbs(values, top_ids, top)


@dataclass(frozen=True)
class Opened:
    """A verifier's answer to an open: the prefill's next token and top-k rows, and its cost curve."""

    next_token: int
    topk: list[int]  # [tokens * topk_width], flattened
    topk_width: int
    cost: Cost | None  # None: not measured
    elapsed_ms: float
    reused_tokens: int = 0  # of the history, found in the verifier's cache (the rest was prefilled)
    logprobs: LogProbs | None = None  # of next_token, when asked for
    # echo: the prefilled history tokens' log-probabilities (None: the first, without its predecessor's)
    echo: LogProbs | None = None
    prefix_tokens: int = 0  # of the history, copied from the verifier's prefix cache (not prefilled)
    fetched_tokens: int = 0  # of those, fetched from the verifier named as their holder


@dataclass(frozen=True)
class Tree:
    tokens: list[int]  # root first
    parents: list[int]  # parents[0] = -1
    elapsed_ms: float  # inside the drafter
    rest: int = 0  # rounds to verify without the drafter after this one (its adaptive budget rests)


@dataclass(frozen=True)
class Verified:
    accepted: list[int]  # node indices of the accepted path, root first
    next_token: int  # the bonus token after that path
    topk: list[int]  # the tree's top-k rows, for the drafter to learn from
    batch_rows: int  # rows of other sessions' trees in the same forward
    elapsed_ms: float  # inside the verifier
    logprobs: LogProbs | None = None  # of the accepted path's successors and the bonus, when asked for
    more: bool = False  # a run's round, not its last: the next one is ``VerifierLink.more``'s to read


@dataclass(frozen=True)
class Feedback:
    """What the drafter learns from a round's verification, sent with its next step."""

    topk: Sequence[int] = ()
    accepted: Sequence[int] = ()
    commit: int = 0  # accepted tokens the drafter keeps (a cut round keeps fewer)
    batch_rows: int = 0
    # the rounds verified without a tree since the last one: their tokens and top-k rows
    plain: Sequence[int] = ()
    plain_topk: Sequence[int] = ()


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
            self._broken = Lost(self.endpoint, f"could not send in {self.timeout:g} s")
        except grpc.aio.AioRpcError as e:
            self._broken = self._classify(e)
        except asyncio.InvalidStateError:  # the call ended before this write (the server went away)
            self._broken = EOFError()

    async def receive(self):
        broken, self._broken = self._broken, None
        try:
            if isinstance(broken, (Lost, Abort)):
                raise broken
            async with asyncio.timeout(self.timeout):
                resp = grpc.aio.EOF if broken is not None else await self.call.read()
                if resp is grpc.aio.EOF:
                    code = await self.call.code()
                    raise self._classify(None, code, await self.call.details())
        except asyncio.TimeoutError:
            raise Lost(self.endpoint, f"no answer in {self.timeout:g} s") from None
        except grpc.aio.AioRpcError as e:
            raise self._classify(e) from None
        return resp

    def _classify(self, e, code=None, details=None):
        code = e.code() if e is not None else code
        details = e.details() if e is not None else details
        if code in _CALLER_ERRORS:
            return Abort(Status[code.name], details or str(code))
        if code in _REFUSED:
            log.error(
                "a backend refused the gateway's credential: check RACER_INTERNAL_TOKEN / the TLS client certificate",
                extra={"endpoint": self.endpoint, "code": code.name, "details": details},
            )
            return Abort(Status.INTERNAL, "the gateway could not authenticate to its backends; see the gateway log")
        draining = code == grpc.StatusCode.UNAVAILABLE and (details or "").startswith(DRAINING)
        return Lost(self.endpoint, f"{code}: {details}", draining)

    async def close(self, cancel: bool = False) -> None:
        if cancel:
            self.call.cancel()
            return
        try:
            await self.call.done_writing()
            if tracing.enabled():
                # The stream's client span ends when its responses do: read its end (the server ends
                # the stream once the requests have), else the span is never exported.
                async with asyncio.timeout(self.timeout):
                    while await self.call.read() is not grpc.aio.EOF:
                        pass
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.TimeoutError):
            pass


class DrafterLink(_Link):
    async def open(
        self,
        session_id: str,
        tenant: str,
        history: list[int],
        history_topk: list[int],
        topk_width: int,
        cost: Cost | None,
        overhead_ms: float,
        share: bool = True,
        corpus: bool = True,
        corpus_tokens: int = 0,
        plain_overhead_ms: float | None = None,
    ) -> tuple[str, float]:
        """Where the drafter found the session ("memory", "snapshot", "history", "new") and its ms."""
        resp = await self.ask(
            dpb.DraftRequest(
                open=dpb.DrafterOpen(
                    session_id=session_id,
                    tenant=tenant,
                    history=history,
                    history_topk=history_topk,
                    topk=topk_width,
                    cost=cpb.CostCurve(**cost._asdict()) if cost is not None else None,
                    overhead_ms=overhead_ms,
                    no_share=not share,
                    no_corpus=not corpus,
                    corpus_tokens=corpus_tokens,
                    plain_overhead_ms=plain_overhead_ms,
                )
            )
        )
        return resp.restored_from, resp.elapsed_ms

    async def send_step(self, root: int, budget: int, mode: str, feedback: Feedback, forced=()) -> None:
        """The next step; ``receive_tree`` reads its tree (so the gateway can work while the drafter does).
        ``forced``: tokens that must follow the root (a grammar's only choices), drafted as a path."""
        await self.send(
            dpb.DraftRequest(
                step=dpb.DraftStep(
                    tree_topk=feedback.topk,
                    accepted=feedback.accepted,
                    commit=feedback.commit,
                    root=root,
                    budget=budget,
                    mode=mode,
                    batch_rows=feedback.batch_rows,
                    forced=forced,
                    plain=feedback.plain,
                    plain_topk=feedback.plain_topk,
                )
            )
        )

    async def receive_tree(self) -> Tree:
        resp = await self.receive()
        return Tree(list(resp.tree.tokens), list(resp.tree.parents), resp.elapsed_ms, resp.rest)

    async def end_turn(self, tokens: list[int]) -> None:
        """The drafter may snapshot the session now: no step comes before the next turn's open.
        ``tokens``: every token the session gained since this stream's open (``EndTurn``)."""
        await self.ask(dpb.DraftRequest(end_turn=dpb.EndTurn(tokens=tokens)))


class VerifierLink(_Link):
    async def open(
        self,
        session_id: str,
        tenant: str,
        history: list[int],
        sampling,
        reserve_tokens: int = 0,
        mask: bytes = b"",
        logprobs: int = -1,
        adjust: tuple = ({}, 0.0, 0.0),
        echo: bool = False,
        generated_tokens: int = 0,
        cache_scope: str = "",
        prompt_topk: int | None = None,
        stop_ids: Sequence[int] = (),
        prefix_source: tuple[str, int, str] | None = None,
    ) -> Opened:
        """Prefills ``history`` (what the verifier's cache lacks of it); ``sampling``: a SamplingParams;
        ``reserve_tokens``: new tokens the turn may add (the verifier reserves KV memory for them);
        ``mask``: the tokens allowed next (packed, empty: all); ``logprobs``: -1 none, else top n;
        ``cache_scope``: the tenant's sharing group for the prefix cache ("": its own);
        ``prompt_topk``: at most this many prompt rows' top-k (None: the verifier's setting);
        ``stop_ids``: the tokens that end a run (``verify(run=...)``); ``prefix_source``: (address,
        blocks, session id) of another verifier holding the history's leading blocks, which this one
        may fetch (with a session id: a hand-over, that verifier drains and holds the session's rows)."""
        s = vpb.Sampling(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if sampling.seed is not None:
            s.seed = sampling.seed
        op = vpb.VerifierOpen(
            session_id=session_id,
            tenant=tenant,
            history=history,
            sampling=s,
            reserve_tokens=reserve_tokens,
            mask=mask,
            logprobs=logprobs,
            logit_bias=adjust[0],
            presence_penalty=adjust[1],
            frequency_penalty=adjust[2],
            echo=echo,
            generated_tokens=generated_tokens,
            cache_scope=cache_scope,
            prompt_topk=prompt_topk,
            stop_ids=stop_ids,
        )
        if prefix_source is not None:
            address, blocks, handover = prefix_source
            op.prefix_source.CopyFrom(vpb.PrefixSource(address=address, blocks=blocks, session_id=handover))
        resp = await self.ask(vpb.VerifyRequest(open=op))
        c = resp.cost
        cost = Cost(tuple(c.sizes), tuple(c.ms), c.context, tuple(c.ms_per_token)) if c.sizes else None
        return Opened(
            resp.next_token,
            list(resp.topk),
            resp.topk_width,
            cost,
            resp.elapsed_ms,
            resp.reused_tokens,
            _logprobs(resp),
            _echo(resp) if echo else None,
            resp.prefix_tokens,
            resp.fetched_tokens,
        )

    async def verify(self, tokens: list[int], parents: list[int], masks: bytes = b"", run: int = 0) -> Verified:
        """``masks``: per node, the tokens allowed after its path (packed, empty: all). ``run`` > 1 (the
        root alone): this round and up to ``run`` - 1 more, each at the last one's next token; while
        the answer says ``more``, the next round's is ``more()``'s to read."""
        tree = vpb.VerifyTree(tokens=tokens, parents=parents, masks=masks, run=run)
        return _verified(await self.ask(vpb.VerifyRequest(tree=tree)))

    async def more(self) -> Verified:
        """The next round of the run in progress (the last answer said ``more``)."""
        return _verified(await self.receive())


def _verified(resp) -> Verified:
    return Verified(
        list(resp.accepted),
        resp.next_token,
        list(resp.topk),
        resp.batch_rows,
        resp.elapsed_ms,
        _logprobs(resp),
        resp.more,
    )


@dataclass
class Load:
    """What a verifier last said of its load (``Stats``), and the sessions placed on it since."""

    saturation: float = 0.0  # verifier/load.py: 1 = saturated
    streaming: int = 0  # streams open on it, from every gateway
    draining: bool = False
    placed: int = 0  # sessions this gateway opened on it since that report
    silent: bool = False  # did not answer the last poll (not up yet, or going): tried after the others
    prefix_blocks: frozenset[int] = frozenset()  # its prefix cache's blocks (``common.prefix.key_id``)
    block_tokens: int = 0  # tokens per prefix-cache block (0: no prefix cache)
    epoch: int = 0  # changes when it restarts (with a cold cache)
    fingerprint: str = ""  # what its rows depend on: blocks move only between equal ones

    def rank(self) -> tuple[float, int]:
        """Lower is better: saturation in steps of 0.1, then streams (those placed since included)."""
        return (int(self.saturation * 10) / 10, self.streaming + self.placed)

    def overlap(self, scope: str, tokens: list[int], keys: dict) -> float:
        """The share of ``tokens``' full blocks that its prefix cache holds as a prefix, 0 to 1
        (``keys``: block size -> the tokens' key ids, computed once per placement)."""
        if not self.block_tokens or not self.prefix_blocks or len(tokens) < self.block_tokens:
            return 0.0
        return self.held(scope, tokens, keys) / (len(tokens) // self.block_tokens)

    def held(self, scope: str, tokens: list[int], keys: dict) -> int:
        """How many of ``tokens``' leading full blocks its prefix cache holds."""
        if not self.block_tokens or not self.prefix_blocks or len(tokens) < self.block_tokens:
            return 0
        ids = keys.get(self.block_tokens)
        if ids is None:
            ids = keys[self.block_tokens] = [key_id(k) for k in chain_keys(scope, tokens, self.block_tokens)]
        return next((i for i, k in enumerate(ids) if k not in self.prefix_blocks), len(ids))


class Backends:
    """The drafters and verifiers of one gateway, and how to reach them."""

    def __init__(self, drafters: Endpoints, verifiers: Endpoints, timeout_s: float, load_every: float = 1.0):
        self.drafters = drafters
        self.verifiers = verifiers
        self.timeout_s = timeout_s  # a message without an answer this long: the stream is lost
        self.verifier_load: dict[str, int] = {}  # endpoint -> turns streaming to it from this gateway
        self.load_every = load_every  # seconds a verifier's load report is used before it is asked again
        self.loads: dict[str, Load] = {}  # endpoint -> its last report (every gateway's sessions counted)
        self._loads_at = float("-inf")
        self._polling: asyncio.Task | None = None
        self.warm_seconds = 120.0  # a warm-up's bound, as the gateway waits for it (the verifier's is its own)
        self._warming: set[asyncio.Task] = set()
        self._polled = False  # verifiers answering the first poll are the fleet as found, not joining

    def opened(self, verifier: str) -> None:
        """A turn's stream to ``verifier`` is open: new sessions prefer the verifiers with fewer."""
        self.verifier_load[verifier] = self.verifier_load.get(verifier, 0) + 1

    def closed(self, verifier: str) -> None:
        self.verifier_load[verifier] -= 1

    def placed(self, verifier: str) -> None:
        """A new session went to ``verifier``: counted until its next report, so that sessions
        placed between two reports spread out instead of all taking the same one."""
        self.loads.setdefault(verifier, Load()).placed += 1

    async def refresh_loads(self, endpoints: list[str]) -> dict[str, Load]:
        """Every verifier's load as it reports it, asked again after ``load_every`` seconds (one
        poll at a time; a verifier that does not answer within a second ranks after those that
        did). The reports count all gateways' sessions, not only this one's."""
        if time.monotonic() - self._loads_at >= self.load_every:
            if self._polling is None or self._polling.done():
                self._polling = asyncio.ensure_future(self._poll(list(endpoints)))
            await asyncio.shield(self._polling)
        return self.loads

    async def _poll(self, endpoints: list[str]) -> None:
        async def ask(ep: str):
            stub = vgrpc.VerifierStub(self.verifiers.channel(ep))
            return await stub.Stats(vpb.VerifierStatsRequest(), timeout=1.0, metadata=self.verifiers.metadata)

        results = await asyncio.gather(*(ask(ep) for ep in endpoints), return_exceptions=True)
        self._loads_at = time.monotonic()
        joined: list[str] = []  # verifiers first heard from (or restarted): warmed if cold
        for ep, res in zip(endpoints, results):
            if isinstance(res, Exception):
                load = self.loads.setdefault(ep, Load())
                load.silent = True  # its last report stays, for a tie
                load.prefix_blocks = frozenset()  # but not what it held: it may come back cold
                continue
            old = self.loads.get(ep)
            if old is not None and old.epoch and old.epoch != res.epoch:
                log.info("verifier restarted: its prefix cache is cold", extra={"endpoint": ep})
            self.loads[ep] = Load(
                res.saturation,
                res.streaming,
                res.draining,
                prefix_blocks=frozenset(res.prefix_blocks),
                block_tokens=res.prefix_block_tokens,
                epoch=res.epoch,
                fingerprint=res.setup.prefix_fingerprint,
            )
            if self._polled and (old is None or old.epoch != res.epoch):
                joined.append(ep)
        for ep in list(self.loads):
            if ep not in endpoints:
                del self.loads[ep]
        self._polled = True
        for ep in joined:
            self._warm(ep)

    def _warm(self, ep: str) -> None:
        """``ep`` joined since this gateway's first poll (or restarted) with an empty prefix cache: it is asked to warm
        from the verifier that reports the most blocks (of its fingerprint, not silent), in the
        background. Several gateways may ask; the verifier warms once."""
        load = self.loads[ep]
        if load.prefix_blocks or not load.block_tokens or not load.fingerprint or load.draining:
            return
        holders = [
            (len(h.prefix_blocks), e)
            for e, h in self.loads.items()
            if e != ep and not h.silent and h.prefix_blocks and h.fingerprint == load.fingerprint
        ]
        if not holders:
            return
        source = max(holders)[1]
        task = asyncio.ensure_future(self._ask_warm(ep, source))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _ask_warm(self, ep: str, source: str) -> None:
        stub = vgrpc.VerifierStub(self.verifiers.channel(ep))
        try:
            res = await stub.Warm(
                vpb.VerifierWarmRequest(source=source), timeout=self.warm_seconds, metadata=self.verifiers.metadata
            )
        except grpc.aio.AioRpcError as e:
            M.VERIFIER_WARMS.labels("failed").inc()
            log.warning("verifier warm-up failed", extra={"endpoint": ep, "source": source, "error": str(e.code())})
            return
        M.VERIFIER_WARMS.labels("warmed" if res.blocks else "refused").inc()
        log.info(
            "verifier warmed",
            extra={"endpoint": ep, "source": source, "blocks": res.blocks, "bytes": res.bytes, "refused": res.refused},
        )

    def drafter(self, endpoint: str) -> DrafterLink:
        call = dgrpc.DrafterStub(self.drafters.channel(endpoint)).Session(metadata=self.drafters.metadata)
        return DrafterLink(endpoint, call, self.timeout_s)

    def verifier(self, endpoint: str) -> VerifierLink:
        call = vgrpc.VerifierStub(self.verifiers.channel(endpoint)).Session(metadata=self.verifiers.metadata)
        return VerifierLink(endpoint, call, self.timeout_s)

    async def drop(self, session_id: str, tenant: str, verifier: str) -> None:
        """Best effort: every drafter (any may hold a copy after a failover) and the session's verifier."""
        calls = [
            dgrpc.DrafterStub(self.drafters.channel(ep)).Drop(
                dpb.DropRequest(session_id=session_id, tenant=tenant), timeout=5, metadata=self.drafters.metadata
            )
            for ep in self.drafters.endpoints
        ]
        if verifier:
            calls.append(
                vgrpc.VerifierStub(self.verifiers.channel(verifier)).Drop(
                    vpb.VerifierDropRequest(session_id=session_id, tenant=tenant),
                    timeout=5,
                    metadata=self.verifiers.metadata,
                )
            )
        for res in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(res, Exception):
                log.warning("drop failed", extra={"session_id": session_id, "error": repr(res)})
