"""The verifier service: the ``Verifier`` RPCs over ``verifier.sessions``, protobuf in and out; and
its client side towards other verifiers (``PeerFetcher``: their prefix blocks, ``prefix_fetch.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict

import grpc
from opentelemetry import trace

from common.costs import ContextSlope
from common.errors import Abort, Status
from common.session_stream import SessionStream
from common.v1 import common_pb2 as cpb
from common.v1 import verifier_pb2 as pb
from common.v1 import verifier_pb2_grpc as pb_grpc

from . import load
from . import metrics as M
from .constraints import Adjust, unpack
from .prefix_fetch import Ask, Header, Refused, WireBlock
from .sessions import Entry, Open, Verifier

log = logging.getLogger("racer.verifier")

tracer = trace.get_tracer("racer.verifier")


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        # Set on SIGTERM: every request that arrives from then on is refused (UNAVAILABLE, draining),
        # while those already being served finish: a stream ends after its round in flight and the
        # gateway re-opens the session on another verifier (re-prefill from the history).
        self.draining = False

    async def Session(self, request_iterator, context):
        async with contextlib.aclosing(_VerifyStream(self, context).serve(request_iterator)) as responses:
            async for resp in responses:
                yield resp

    async def Drop(self, request, context):
        return pb.VerifierDropResponse(existed=self.verifier.drop(request.tenant, request.session_id))

    async def PrefixBlocks(self, request, context):
        """Served while draining too: a draining verifier's blocks are still good to hand over."""
        ask = Ask(
            tenant=request.tenant,
            scope=request.cache_scope,
            tokens=list(request.tokens),
            first=request.first_block,
            block=request.block_tokens,
            fingerprint=request.fingerprint,
            max_bytes=request.max_bytes,
            session=request.session_id,
            hottest=request.hottest,
        )
        async with contextlib.aclosing(self.verifier.serve_prefix(ask)) as items:
            async for item in items:
                if isinstance(item, Header):
                    header = pb.PrefixBlocksHeader(
                        fingerprint=item.fingerprint, blocks=item.blocks, block_bytes=item.block_bytes
                    )
                    yield pb.PrefixBlocksChunk(header=header)
                else:
                    block = pb.PrefixBlock(
                        index=item.index,
                        key=item.key,
                        scope=item.scope,
                        rows=item.rows,
                        digest=item.digest,
                        tokens=item.tokens,
                        parent=item.parent,
                    )
                    yield pb.PrefixBlocksChunk(block=block)

    async def Warm(self, request, context):
        """A gateway's request to this verifier, which just joined: fill the prefix cache from the
        verifier at ``source`` (its hottest blocks)."""
        if not request.source:
            raise Abort(Status.INVALID_ARGUMENT, "warm: source required", field="source")
        if self.draining:
            raise Abort(Status.FAILED_PRECONDITION, "warm: this verifier drains")
        blocks, nbytes, refused = await self.verifier.warm(request.source)
        return pb.VerifierWarmResponse(blocks=blocks, bytes=nbytes, refused=refused)

    async def Stats(self, request, context):
        return pb.VerifierStatsResponse(
            # the core's SessionStats has the message's field names
            sessions=[pb.VerifierSessionStats(**asdict(s)) for s in self.verifier.stats()],
            cache_tokens=self.verifier.cache_tokens,
            cost=_cost_curve(self.verifier),
            saturation=load.of(self.verifier),
            streaming=self.verifier.streaming(),
            draining=self.draining,
            prefix_blocks=self.verifier.prefix_held(),
            prefix_block_tokens=self.verifier.prefix.block if self.verifier.prefix is not None else 0,
            epoch=self.verifier.epoch,
            setup=_setup(self.verifier.setup(), self.verifier.fingerprint),
        )


def _setup(s, fingerprint: str = "") -> pb.VerifierSetup:
    checks = [pb.KernelCheck(kernel=c.kernel, ok=c.ok, detail=c.detail) for c in s.kernel_checks]
    fields = {k: v for k, v in asdict(s).items() if k != "kernel_checks"}
    return pb.VerifierSetup(**fields, kernel_checks=checks, prefix_fingerprint=fingerprint)


class PeerFetcher:
    """The verifier's channels to other verifiers, for their prefix blocks: one per address, with
    ``metadata`` (the internal token) on every call, ``credentials`` (None: plaintext) and the
    channel ``options``. Called as the core's ``fetcher``: plain values out, a failed call as
    ``Refused`` (FAILED_PRECONDITION: the holder refused the fingerprint) or ``grpc.RpcError``."""

    MAX_CHANNELS = 64

    def __init__(self, metadata=(), credentials=None, options=()):
        self.metadata = tuple(metadata)
        self.credentials = credentials
        self.options = list(options)
        self.channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self.channels.get(address)
        if ch is None:
            if len(self.channels) >= self.MAX_CHANNELS:  # addresses come and go (pods): the oldest goes
                old = self.channels.pop(next(iter(self.channels)))
                asyncio.ensure_future(old.close())
            if self.credentials is not None:
                ch = grpc.aio.secure_channel(address, self.credentials, options=self.options)
            else:
                ch = grpc.aio.insecure_channel(address, options=self.options)
            self.channels[address] = ch
        return ch

    async def __call__(self, address: str, ask: Ask, seconds: float):
        req = pb.PrefixBlocksRequest(
            tenant=ask.tenant,
            cache_scope=ask.scope,
            tokens=ask.tokens,
            first_block=ask.first,
            block_tokens=ask.block,
            fingerprint=ask.fingerprint,
            max_bytes=ask.max_bytes,
            session_id=ask.session,
            hottest=ask.hottest,
        )
        call = pb_grpc.VerifierStub(self.channel(address)).PrefixBlocks(
            req, timeout=max(seconds, 0.001), metadata=self.metadata
        )
        try:
            async for chunk in call:
                if chunk.HasField("header"):
                    h = chunk.header
                    yield Header(h.fingerprint, h.blocks, h.block_bytes)
                else:
                    b = chunk.block
                    yield WireBlock(b.index, b.key, b.scope, b.rows, b.digest, tuple(b.tokens), b.parent)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in (e.details() or ""):
                raise Refused("fingerprint", e.details()) from None
            raise
        finally:
            call.cancel()

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()
        self.channels.clear()


class _VerifyStream(SessionStream[Entry]):
    """One verifier ``Session`` stream: ``open`` (prefill), then a ``tree`` per round (or per run of
    rounds without a draft: the verifier goes on at each round's next token by itself)."""

    service = "verifier"

    def __init__(self, servicer: VerifierService, context):
        super().__init__()
        self.servicer = servicer
        self.verifier = servicer.verifier
        self.context = context  # the call's deadline bounds the prefill
        self.stop_ids: frozenset[int] = frozenset()

    def handlers(self):
        return {"tree": self.tree}

    async def open(self, op: pb.VerifierOpen) -> pb.VerifyResponse:
        v = self.verifier
        s = op.sampling
        if op.HasField("prompt_topk") and op.prompt_topk < 0:
            raise Abort(Status.INVALID_ARGUMENT, f"open.prompt_topk: {op.prompt_topk}, at least 0", field="prompt_topk")
        sampling = (s.temperature, s.top_p or 1.0, s.top_k, s.seed if s.HasField("seed") else None)
        history = list(op.history)
        self.entry = v.claim(
            Open(
                tenant=op.tenant,
                session_id=op.session_id,
                history=history,
                sampling=sampling,
                reserve_tokens=op.reserve_tokens,
                scope=op.cache_scope,
            )
        )
        session = self.entry.session
        session.logprobs = max(-1, min(op.logprobs, 20))
        session.generated = history[len(history) - op.generated_tokens :] if op.generated_tokens > 0 else []
        session.echo, session.echo_out, session._echo_prev = op.echo, [], None
        try:
            session.adjust = Adjust.of(
                dict(op.logit_bias), op.presence_penalty, op.frequency_penalty, self.verifier.vocab_size
            )
        except ValueError as e:
            raise Abort(Status.INVALID_ARGUMENT, str(e), field="logit_bias") from None
        self.stop_ids = frozenset(op.stop_ids)  # where a run ends
        session.open_mask = self._masks(op.mask, 1, "open.mask")
        if session.open_mask is not None:
            session.open_mask = session.open_mask[0]
        with tracer.start_as_current_span("verifier.prefill") as span:
            top = op.prompt_topk if op.HasField("prompt_topk") else None
            source = None
            if op.HasField("prefix_source"):
                if op.prefix_source.blocks < 0:
                    raise Abort(
                        Status.INVALID_ARGUMENT,
                        f"open.prefix_source.blocks: {op.prefix_source.blocks}, at least 0",
                        field="prefix_source",
                    )
                ps = op.prefix_source
                source = (ps.address, ps.blocks, ps.session_id)
            res = await v.open(self.entry, history, self.context.time_remaining(), op.reserve_tokens, top, source)
            span.set_attributes({"racer.history_tokens": len(history), "racer.reused_tokens": res.reused_tokens})
        echo = {}
        if session.echo:
            out, session.echo, session.echo_out = session.echo_out, False, []
            echo = dict(
                echo_logprobs=[float("nan") if v is None else v for v, _, _ in out],
                echo_top_ids=[t for _, ids, _ in out for t in ids],
                echo_top_logprobs=[w for _, _, vals in out for w in vals],
            )
        return self._answer(
            res,
            reused_tokens=res.reused_tokens,
            prefix_tokens=res.prefix_tokens,
            fetched_tokens=res.fetched_tokens,
            cost=_cost_curve(v),
            **echo,
        )

    async def tree(self, tree: pb.VerifyTree) -> AsyncIterator[pb.VerifyResponse]:
        """The tree's response; with a run (``VerifyTree.run``), one per round of it."""
        run = tree.run
        if run < 0:
            raise Abort(Status.INVALID_ARGUMENT, f"tree.run: {run}, at least 0", field="run")
        if run > 1 and (len(tree.tokens) != 1 or tree.masks):
            raise Abort(
                Status.INVALID_ARGUMENT,
                f"tree.run: a run verifies the root alone, without masks ({len(tree.tokens)} tokens given)",
                field="run",
            )
        self.entry.session.masks = self._masks(tree.masks, len(tree.tokens), "tree.masks")
        res = await self.verifier.verify(self.entry, list(tree.tokens), list(tree.parents))
        for _ in range(run - 1):  # the run's rounds: each the last one's next token alone
            if res.next_token in self.stop_ids or self.draining():
                break
            yield self._answer(res, accepted=res.accepted, batch_rows=res.batch_rows, more=True)
            res = await self.verifier.verify(self.entry, [res.next_token], [-1])
            M.RUN_ROUNDS.inc()
        yield self._answer(res, accepted=res.accepted, batch_rows=res.batch_rows)

    def _masks(self, data: bytes, rows: int, field: str):
        try:
            return unpack(data, rows, self.verifier.vocab_size)
        except ValueError as e:
            raise Abort(Status.INVALID_ARGUMENT, f"{field}: {e}", field=field) from None

    def _answer(self, res, **fields) -> pb.VerifyResponse:
        """What every answer carries (after open: the next token; after a tree: the bonus token)."""
        lp = res.logprobs
        if lp is not None:
            fields.update(
                logprobs=lp.chosen,
                top_ids=[t for row in lp.top_ids for t in row],
                top_logprobs=[v for row in lp.top for v in row],
            )
        return pb.VerifyResponse(
            next_token=res.next_token,
            topk=res.topk,
            topk_width=self.verifier.topk,
            cache_tokens=res.cache_tokens,
            elapsed_ms=res.elapsed_ms,
            **fields,
        )

    def release(self, entry: Entry) -> None:
        self.verifier.release(entry)

    async def before_refusal(self) -> None:
        self.verifier.leaving(self.entry)  # it moves: its next verifier may ask for its rows

    def draining(self) -> bool:
        return self.servicer.draining


def _cost_curve(verifier: Verifier) -> cpb.CostCurve:
    cost, slope = verifier.cost, verifier.slope
    if slope is None or not cost:
        return cpb.CostCurve(sizes=list(cost), ms=list(cost.values()))
    per_token = [slope.at(n) for n in cost]
    try:  # what a drafter checks it by: one it would refuse would fail the turn's open there
        ContextSlope(slope.context, dict(zip(cost, per_token)))
    except ValueError as e:  # never expected (seen once, cause unknown): logged with its values, left out
        log.error("context slope not sent", extra={"error": str(e), "per_token": per_token, "cost": dict(cost)})
        return cpb.CostCurve(sizes=list(cost), ms=list(cost.values()))
    return cpb.CostCurve(sizes=list(cost), ms=list(cost.values()), context=slope.context, ms_per_token=per_token)
