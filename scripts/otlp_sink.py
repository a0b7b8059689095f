"""A local OTLP/gRPC trace collector that keeps nothing: it accepts every export, counts the spans
by service and span name, and prints the counts when stopped (SIGTERM or Ctrl-C). For measuring
what tracing costs the services without a real backend (docs/serving/observability.md, "Traces").

    PYTHONPATH=. python scripts/otlp_sink.py [--port 4317] &
    RACER_OTLP_ENDPOINT=http://127.0.0.1:4317 racer bench-stack ...
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections import Counter

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc


class Sink(pb_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: Counter[tuple[str, str]] = Counter()
        self.traces: set[bytes] = set()

    async def Export(self, request, context):
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "?")
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self.spans[service, span.name] += 1
                    self.traces.add(span.trace_id)
        return pb.ExportTraceServiceResponse()


async def main(port: int) -> None:
    sink = Sink()
    server = grpc.aio.server()
    pb_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"OTLP sink on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)
    print(f"{len(sink.traces)} traces, {sum(sink.spans.values())} spans")
    for (service, name), n in sorted(sink.spans.items()):
        print(f"  {service:16} {name:36} {n}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=4317)
    asyncio.run(main(ap.parse_args().port))
