"""Two turns of one session through services in this process with tracing on (spans kept in
memory), printed as JSON: what tests/common/test_tracing.py checks. Run as a module in a process of
its own: a process installs one tracer provider, and the other tests run without one.

    python -m tests.support.traced
"""

from __future__ import annotations

import json

import grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common import tracing
from gateway.requests import Request
from racer.client import Client
from tests.support.models import make_tiny_llama, single_thread
from tests.support.stack import LoopThread, prompt, start_stack

N = 40


def main() -> None:
    exporter = InMemorySpanExporter()
    tracing.setup("test", exporter=exporter)
    lt = LoopThread()
    model = make_tiny_llama()
    turns = []
    with single_thread():
        st = start_stack(lt, model)
        try:
            session = ""
            with Client(st.gateway, timeout=60) as c:
                for t in range(2):
                    ids, _, last = c.complete(prompt(t), session_id=session, max_new_tokens=N, budget=8)
                    session = last.session_id
                    s = last.stats
                    turns.append({"ids": ids, "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted})
                try:  # an error through the tracing interceptors keeps its status and message
                    c.complete(prompt(2), session_id="no-such-session", max_new_tokens=N)
                    error = None
                except grpc.RpcError as e:
                    error = {"code": e.code().name, "details": e.details()}
            # A turn from outside a traced RPC (as the HTTP API runs them): the gateway core directly.
            gw = st.gateway_pair[1]
            request = Request(input="prompt_ids", prompt_ids=tuple(prompt(3)), max_new_tokens=N, budget=8)

            async def direct():
                return [item async for item in gw.generate("local", request)]

            s = lt.run(direct())[-1].stats
            direct_turn = {"rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted}
        finally:
            st.stop()
            lt.close()
    spans = [
        {
            "name": s.name,
            "scope": s.instrumentation_scope.name,
            "kind": s.kind.name,
            "trace_id": format(s.context.trace_id, "032x"),
            "span_id": format(s.context.span_id, "016x"),
            "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
            "start": s.start_time,
            "end": s.end_time,
            "attributes": dict(s.attributes or {}),
            "status": s.status.status_code.name,
        }
        for s in exporter.get_finished_spans()
    ]
    print(json.dumps({"turns": turns, "error": error, "direct": direct_turn, "spans": spans}))


if __name__ == "__main__":
    main()
