"""The verifier service: the ``Verifier`` RPCs over ``verifier.sessions``, protobuf in and out."""

from __future__ import annotations

from opentelemetry import trace

from common.errors import Abort, Status, draining
from common.v1 import common_pb2 as cpb
from common.v1 import verifier_pb2 as pb
from common.v1 import verifier_pb2_grpc as pb_grpc

from . import load
from .sessions import Entry, Open, Verifier

tracer = trace.get_tracer("racer.verifier")


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        # Set on SIGTERM: every request that arrives from then on is refused (UNAVAILABLE, draining),
        # while those already being served finish: a stream ends after its round in flight and the
        # gateway re-opens the session on another verifier (re-prefill from the history).
        self.draining = False

    async def Session(self, request_iterator, context):
        v = self.verifier
        entry: Entry | None = None
        try:
            async for req in request_iterator:
                if self.draining:
                    raise draining("verifier")
                kind = req.WhichOneof("kind")
                if kind == "open":
                    if entry is not None:
                        raise Abort(Status.FAILED_PRECONDITION, "open: this stream already has a session")
                    op = req.open
                    s = op.sampling
                    entry = v.claim(
                        Open(
                            op.tenant,
                            op.session_id,
                            list(op.history),
                            (s.temperature, s.top_p or 1.0, s.top_k, s.seed if s.HasField("seed") else None),
                            reserve_tokens=op.reserve_tokens,
                        )
                    )
                    with tracer.start_as_current_span("verifier.prefill") as span:
                        res = await v.open(entry, list(op.history), context.time_remaining(), op.reserve_tokens)
                        span.set_attributes(
                            {"racer.history_tokens": len(op.history), "racer.reused_tokens": res.reused_tokens}
                        )
                    yield pb.VerifyResponse(
                        next_token=res.next_token,
                        topk=res.topk,
                        topk_width=v.topk,
                        reused_tokens=res.reused_tokens,
                        cache_tokens=res.cache_tokens,
                        elapsed_ms=res.elapsed_ms,
                        cost=self._cost_curve(),
                    )
                elif kind == "tree":
                    if entry is None:
                        raise Abort(Status.FAILED_PRECONDITION, "tree: open the session first")
                    res = await v.verify(entry, list(req.tree.tokens), list(req.tree.parents))
                    yield pb.VerifyResponse(
                        next_token=res.next_token,
                        accepted=res.accepted,
                        topk=res.topk,
                        topk_width=v.topk,
                        cache_tokens=res.cache_tokens,
                        elapsed_ms=res.elapsed_ms,
                        batch_rows=res.batch_rows,
                    )
                else:
                    raise Abort(Status.INVALID_ARGUMENT, "request: set one of open, tree")
        finally:
            if entry is not None:
                v.release(entry)

    def _cost_curve(self) -> cpb.CostCurve:
        cost = self.verifier.cost
        return cpb.CostCurve(sizes=list(cost), ms=list(cost.values()))

    async def Drop(self, request, context):
        return pb.VerifierDropResponse(existed=self.verifier.drop(request.tenant, request.session_id))

    async def Stats(self, request, context):
        return pb.VerifierStatsResponse(
            sessions=[
                pb.VerifierSessionStats(
                    session_id=s.session_id,
                    tenant=s.tenant,
                    cache_tokens=s.cache_tokens,
                    streaming=s.streaming,
                    idle_seconds=s.idle_seconds,
                )
                for s in self.verifier.stats()
            ],
            cache_tokens=self.verifier.cache_tokens,
            cost=self._cost_curve(),
            saturation=load.of(self.verifier),
            streaming=self.verifier.streaming(),
            draining=self.draining,
        )
