"""The drafter service: the ``Drafter`` RPCs over ``drafter.sessions``, protobuf in and out."""

from __future__ import annotations

import time

from opentelemetry import trace

from common.errors import Abort, Status, draining
from common.errors import check as _check
from common.v1 import drafter_pb2 as pb
from common.v1 import drafter_pb2_grpc as pb_grpc

from . import metrics as M
from .sessions import Drafter, Entry, Open, Step

tracer = trace.get_tracer("racer.drafter")


class DrafterService(pb_grpc.DrafterServicer):
    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        # Set on SIGTERM: a request that arrives from then on is refused (UNAVAILABLE, draining)
        # once the session's snapshot is in the store, so the next drafter restores it from there.
        self.draining = False

    async def Session(self, request_iterator, context):
        d = self.drafter
        entry: Entry | None = None
        try:
            async for req in request_iterator:
                if self.draining:
                    await d.flush()  # this session's snapshot written before the gateway moves it
                    raise draining("drafter")
                t0 = time.perf_counter()
                kind = req.WhichOneof("kind")
                if kind == "open":
                    _check(entry is None, Status.FAILED_PRECONDITION, "open: this stream already has a session")
                    with tracer.start_as_current_span("drafter.open") as span:
                        entry, source = await d.open(_open(req.open))
                        span.set_attributes(
                            {"racer.history_tokens": len(req.open.history), "racer.restored_from": source}
                        )
                    resp = pb.DraftResponse(tokens=len(entry.session.history), restored_from=source)
                elif kind == "step":
                    _check(entry is not None, Status.FAILED_PRECONDITION, "step: open the session first")
                    st = req.step
                    tree = d.step(
                        entry,
                        Step(
                            list(st.tree_topk),
                            list(st.accepted),
                            st.commit,
                            st.root,
                            st.budget,
                            st.mode or "racer",
                            st.batch_rows,
                        ),
                    )
                    resp = pb.DraftResponse(
                        tree=pb.DraftTree(tokens=tree.tokens, parents=tree.parents, retrieval_nodes=tree.n_retrieval),
                        tokens=len(entry.session.history),
                    )
                    M.DRAFT_SECONDS.observe(time.perf_counter() - t0)
                elif kind == "end_turn":
                    _check(entry is not None, Status.FAILED_PRECONDITION, "end_turn: open the session first")
                    d.end_turn(entry)
                    resp = pb.DraftResponse(tokens=len(entry.session.history))
                else:
                    raise Abort(Status.INVALID_ARGUMENT, "request: set one of open, step, end_turn")
                resp.elapsed_ms = (time.perf_counter() - t0) * 1e3
                yield resp
                if entry is not None:
                    d.after_response(entry)
        finally:
            if entry is not None:
                d.release(entry)

    async def Drop(self, request, context):
        return pb.DropResponse(existed=await self.drafter.drop(request.tenant, request.session_id))

    async def EraseCorpus(self, request, context):
        return pb.EraseCorpusResponse(existed=await self.drafter.erase_corpus(request.tenant))

    async def Stats(self, request, context):
        return pb.DrafterStatsResponse(
            sessions=[
                pb.DrafterSessionStats(
                    session_id=s.session_id,
                    tenant=s.tenant,
                    tokens=s.tokens,
                    nodes=s.nodes,
                    memory_bytes=s.memory_bytes,
                    streaming=s.streaming,
                )
                for s in self.drafter.stats()
            ]
        )


def _open(op: pb.DrafterOpen) -> Open:
    cost = None
    if op.cost.sizes:
        _check(
            len(op.cost.sizes) == len(op.cost.ms), Status.INVALID_ARGUMENT, "open.cost: sizes and ms differ in length"
        )
        cost = dict(zip(op.cost.sizes, op.cost.ms))
    return Open(
        op.tenant,
        op.session_id,
        list(op.history),
        list(op.history_topk),
        op.topk,
        cost,
        op.overhead_ms,
        share=not op.no_share,
        corpus=not op.no_corpus,
        corpus_tokens=op.corpus_tokens,
    )
