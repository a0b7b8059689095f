"""The ``Generation`` servicer: the gateway (``core``) with protobuf in and out, nothing else.

Every RPC copies its request into plain values, calls the core, and copies the answer back;
``Abort`` becomes a gRPC status in ``common.server.ErrorInterceptor``.
"""

from __future__ import annotations

import asyncio
import time

from common.v1 import generation_pb2 as pb
from common.v1 import generation_pb2_grpc as pb_grpc

from . import metrics as M
from .admission import QUEUE_WAIT_HEADER, Queued
from .core import Gateway
from .records import Record
from .requests import Request
from .turn import Chunk, Finished


class GatewayService(pb_grpc.GenerationServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def Generate(self, request: pb.GenerateRequest, context):
        with M.generate_call():  # a bug: the interceptor answers INTERNAL, and it is counted as one
            gw = self.gateway
            tenant = gw.tenant(context.invocation_metadata())
            # a large request (up to the message limit) is copied out of protobuf off the event loop
            req = _request(request) if request.ByteSize() <= 64 * 1024 else await asyncio.to_thread(_request, request)
            waited = None
            async for item in gw.generate(tenant, req, context.time_remaining()):
                if isinstance(item, Queued):  # a gRPC stream needs no keep-alive of its own
                    waited = item
                    continue
                if waited is not None:  # the first answer of a turn that waited: how long, for clients
                    wait_ms = (time.monotonic() - waited.since) * 1e3
                    await context.send_initial_metadata(((QUEUE_WAIT_HEADER, f"{wait_ms:.0f}"),))
                    waited = None
                yield _response(item)

    async def GetSession(self, request, context):
        gw = self.gateway
        rec = await gw.session(gw.tenant(context.invocation_metadata()), request.session_id)
        return self._info(rec)

    async def CloseSession(self, request, context):
        gw = self.gateway
        rec = await gw.close(gw.tenant(context.invocation_metadata()), request.session_id)
        return self._info(rec, closed=True)

    async def ListSessions(self, request, context):
        gw = self.gateway
        recs = await gw.sessions(gw.tenant(context.invocation_metadata()))
        return pb.ListSessionsResponse(sessions=[self._info(rec) for rec in recs])

    def _info(self, rec: Record, closed: bool = False) -> pb.SessionInfo:
        return pb.SessionInfo(
            session_id=rec.session_id,
            turns=rec.turns,
            tokens=len(rec.history),  # no drafter or verifier: backend addresses are not the client's to know
            created_unix=rec.created,
            last_used_unix=rec.last_used,
            closed=closed,
        )


def _request(r: pb.GenerateRequest) -> Request:
    return Request(
        session_id=r.session_id,
        input=r.WhichOneof("input"),
        prompt=r.prompt,
        system=r.system,
        chat=tuple((m.role, m.content) for m in r.chat.messages),
        prompt_ids=tuple(r.prompt_ids.ids),
        max_new_tokens=r.max_new_tokens,
        mode=r.speculation.mode,
        budget=r.speculation.budget,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=r.seed if r.HasField("seed") else None,
        stop=tuple(r.stop),
        stop_ids=tuple(r.stop_ids),
        share=r.share if r.HasField("share") else True,
    )


def _response(item: Chunk | Finished) -> pb.GenerateResponse:
    if isinstance(item, Chunk):
        return pb.GenerateResponse(session_id=item.session_id, text=item.text, token_ids=item.token_ids)
    s = item.stats
    return pb.GenerateResponse(
        session_id=item.session_id,
        finish_reason=item.finish_reason,
        usage=pb.Usage(
            prompt_tokens=item.prompt_tokens,
            completion_tokens=item.completion_tokens,
            session_tokens=item.session_tokens,
        ),
        stats=pb.SpeculationStats(
            rounds=s.rounds,
            drafted=s.drafted,
            accepted=s.accepted,
            mat=s.mat,
            prefill_ms=item.prefill_ms,
            draft_ms=item.draft_ms,
            verify_ms=item.verify_ms,
            total_ms=item.total_ms,
            tokens_per_second=item.tokens_per_second,
        ),
    )
