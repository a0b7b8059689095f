"""The drafter service: the ``Drafter`` RPCs over ``drafter.core``, protobuf in and out."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict

from opentelemetry import trace

from common.costs import ContextSlope
from common.errors import Abort, Status
from common.errors import check as _check
from common.session_stream import SessionStream
from common.v1 import drafter_pb2 as pb
from common.v1 import drafter_pb2_grpc as pb_grpc

from . import metrics as M
from .core import Drafter, Entry, Open, Step

tracer = trace.get_tracer("racer.drafter")


class DrafterService(pb_grpc.DrafterServicer):
    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        # Set on SIGTERM: a request that arrives from then on is refused (UNAVAILABLE, draining)
        # once the session's snapshot is in the store, so the next drafter restores it from there.
        self.draining = False

    async def Session(self, request_iterator, context):
        async with contextlib.aclosing(_DraftStream(self).serve(request_iterator)) as responses:
            async for resp in responses:
                yield resp

    async def Drop(self, request, context):
        return pb.DropResponse(existed=await self.drafter.drop(request.tenant, request.session_id))

    async def EraseCorpus(self, request, context):
        return pb.EraseCorpusResponse(existed=await self.drafter.erase_corpus(request.tenant))

    async def Stats(self, request, context):
        # the core's SessionStats has the message's field names
        return pb.DrafterStatsResponse(sessions=[pb.DrafterSessionStats(**asdict(s)) for s in self.drafter.stats()])


class _DraftStream(SessionStream[Entry]):
    """One drafter ``Session`` stream: ``open``, then ``step`` per round and ``end_turn``."""

    service = "drafter"

    def __init__(self, servicer: DrafterService):
        super().__init__()
        self.servicer = servicer
        self.drafter = servicer.drafter

    def handlers(self):
        return {"step": self.step, "end_turn": self.end_turn}

    async def open(self, op: pb.DrafterOpen) -> pb.DraftResponse:
        t0 = time.perf_counter()
        with tracer.start_as_current_span("drafter.open") as span:
            self.entry, source = await self.drafter.open(_open(op))
            span.set_attributes({"racer.history_tokens": len(op.history), "racer.restored_from": source})
        return self._answer(t0, restored_from=source)

    async def step(self, st: pb.DraftStep) -> pb.DraftResponse:
        t0 = time.perf_counter()
        tree = self.drafter.step(self.entry, _step(st))
        resp = self._answer(
            t0,
            tree=pb.DraftTree(tokens=tree.tokens, parents=tree.parents, retrieval_nodes=tree.n_retrieval),
            rest=self.entry.rest,
        )
        M.DRAFT_SECONDS.observe(time.perf_counter() - t0)
        return resp

    async def end_turn(self, msg: pb.EndTurn) -> pb.DraftResponse:
        t0 = time.perf_counter()
        self.drafter.end_turn(self.entry, msg.tokens)
        return self._answer(t0)

    def _answer(self, t0: float, **fields) -> pb.DraftResponse:
        resp = pb.DraftResponse(tokens=len(self.entry.session.history), **fields)
        resp.elapsed_ms = (time.perf_counter() - t0) * 1e3
        return resp

    def release(self, entry: Entry) -> None:
        self.drafter.release(entry)

    def draining(self) -> bool:
        return self.servicer.draining

    async def before_refusal(self) -> None:
        await self.drafter.flush()  # this session's snapshot written before the gateway moves it

    def responded(self) -> None:
        if self.entry is not None:
            self.drafter.after_response(self.entry)


def _step(st: pb.DraftStep) -> Step:
    return Step(
        tree_topk=list(st.tree_topk),
        accepted=list(st.accepted),
        commit=st.commit,
        root=st.root,
        budget=st.budget,
        mode=st.mode or "racer",
        batch_rows=st.batch_rows,
        forced=tuple(st.forced),
        plain=tuple(st.plain),
        plain_topk=tuple(st.plain_topk),
    )


def _open(op: pb.DrafterOpen) -> Open:
    cost = slope = None
    if op.cost.sizes:
        _check(
            len(op.cost.sizes) == len(op.cost.ms), Status.INVALID_ARGUMENT, "open.cost: sizes and ms differ in length"
        )
        cost = dict(zip(op.cost.sizes, op.cost.ms))
        if op.cost.ms_per_token:
            _check(
                len(op.cost.ms_per_token) == len(op.cost.sizes),
                Status.INVALID_ARGUMENT,
                "open.cost: sizes and ms_per_token differ in length",
            )
            try:
                slope = ContextSlope(op.cost.context, dict(zip(op.cost.sizes, op.cost.ms_per_token)))
            except ValueError as e:
                raise Abort(Status.INVALID_ARGUMENT, f"open.cost: {e}") from None
    return Open(
        tenant=op.tenant,
        session_id=op.session_id,
        history=list(op.history),
        history_topk=list(op.history_topk),
        topk=op.topk,
        cost=cost,
        slope=slope,
        overhead_ms=op.overhead_ms,
        plain_overhead_ms=op.plain_overhead_ms if op.HasField("plain_overhead_ms") else None,
        share=not op.no_share,
        corpus=not op.no_corpus,
        corpus_tokens=op.corpus_tokens,
    )
