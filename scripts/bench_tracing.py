"""What tracing costs a round: the three services in one process with the tiny test model (a
forward of ~1 ms, so the pipeline's own time dominates and a per-round cost shows), tracing off and
on (every turn sampled, spans batched over OTLP to ``scripts/otlp_sink.py``), in alternating
processes. Prints tokens/s, the gateway's per-round overhead (round time minus the drafter's and
the verifier's own time, medians over the turns of each run) and CPU time per token; then
(``--echo``) what the gRPC instrumentation adds to one message round trip on a bidi stream and to
opening and closing one, in blocks that alternate between an instrumented and a plain echo server
in one process.

    PYTHONPATH=. python scripts/bench_tracing.py [--runs 3] [--turns 20] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(turns: int, tokens: int, endpoint: str) -> None:
    import time

    from common import tracing
    from racer.bench.inproc import LoopThread, start_stack
    from racer.bench.tiny import make_tiny_llama, prompt, single_thread
    from racer.client import Client

    tracing.setup("bench", endpoint)
    lt = LoopThread()
    with single_thread():
        st = start_stack(lt, make_tiny_llama())
        tps, overhead = [], []
        try:
            with Client(st.gateway, timeout=120) as c:
                c.complete(prompt(999), max_new_tokens=8)  # warm-up
                cpu0, n = time.process_time(), 0
                for i in range(turns):
                    t0 = time.perf_counter()
                    ids, _, last = c.complete(prompt(i), max_new_tokens=tokens, budget=8)
                    tps.append(len(ids) / (time.perf_counter() - t0))
                    n += len(ids)
                    s = last.stats
                    overhead.append((s.total_ms - s.prefill_ms - s.draft_ms - s.verify_ms) / max(1, s.rounds))
                cpu_us = (time.process_time() - cpu0) / n * 1e6  # all threads: three services and the client
        finally:
            st.stop()
            lt.close()
    print(json.dumps({"tps": statistics.median(tps), "overhead_ms": statistics.median(overhead), "cpu_us": cpu_us}))


async def echo(blocks: int = 7, n: int = 1000) -> None:
    """Round trip of one 64-byte message on a loopback bidi stream, plain vs instrumented (client
    and server interceptors, spans batched to an in-memory exporter)."""
    import time

    import grpc
    from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    async def behaviour(requests, context):
        async for r in requests:
            yield r

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    channels, servers = {}, []
    for setting in ("off", "on"):
        server = grpc.aio.server(interceptors=[aio_server_interceptor(tracer_provider=provider)] * (setting == "on"))
        handler = grpc.stream_stream_rpc_method_handler(behaviour)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"S": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        interceptors = aio_client_interceptors(tracer_provider=provider) if setting == "on" else None
        channels[setting] = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=interceptors)

    async def stream(ch, messages: int) -> None:
        call = ch.stream_stream("/bench.Echo/S")()
        for _ in range(messages):
            await call.write(b"x" * 64)
            await call.read()
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass

    async def many(ch, streams: int) -> None:
        for _ in range(streams):
            await stream(ch, 1)

    async def timed(coro) -> float:
        t0 = time.perf_counter()
        await coro
        return time.perf_counter() - t0

    rtt = {"off": [], "on": []}
    opens = {"off": [], "on": []}
    for ch in channels.values():
        await stream(ch, 200)  # warm-up
    for _ in range(blocks):
        for setting, ch in channels.items():
            rtt[setting].append(await timed(stream(ch, n)) / n * 1e6)
            opens[setting].append(await timed(many(ch, 50)) / 50 * 1e6)
    for ch in channels.values():
        await ch.close()
    for server in servers:
        await server.stop(0)
    print(f"echo: {blocks} blocks of {n} round trips, alternating")
    print("| tracing | µs per message round trip (median, min) | µs to open, send one, close (median) |")
    print("|---|---|---|")
    for setting in ("off", "on"):
        r = rtt[setting]
        print(f"| {setting} | {statistics.median(r):.0f}, {min(r):.0f} | {statistics.median(opens[setting]):.0f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="processes per setting, alternating")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=4418, help="the OTLP sink's port")
    ap.add_argument("--echo", action="store_true", help="also the stream round-trip microbenchmark")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.turns, args.tokens, args.child)
        return 0
    if args.runs:
        stacks(args)
    if args.echo:
        asyncio.run(echo())
    return 0


def stacks(args) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "RACER_OTLP_ENDPOINT"}
    env["PYTHONPATH"] = str(ROOT)
    sink = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "otlp_sink.py"), "--port", str(args.port)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    sink.stdout.readline()  # listening
    rows = {"off": [], "on": []}
    try:
        for _ in range(args.runs):
            for setting, endpoint in (("off", ""), ("on", f"http://127.0.0.1:{args.port}")):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", endpoint, "--turns", str(args.turns)]
                    + ["--tokens", str(args.tokens)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rows[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        sink.terminate()
        spans = sink.communicate(timeout=30)[0].strip().splitlines()
    print(f"runs={args.runs} turns={args.turns} tokens={args.tokens}; sink: {spans[0] if spans else '?'}")
    print("| tracing | tok/s per run | median | overhead ms/round per run | median | CPU µs/token per run | median |")
    print("|---|---|---|---|---|---|---|")
    for setting, r in rows.items():
        tps = [x["tps"] for x in r]
        oh = [x["overhead_ms"] for x in r]
        cpu = [x["cpu_us"] for x in r]
        print(
            f"| {setting} | {', '.join(f'{x:.1f}' for x in tps)} | {statistics.median(tps):.1f} | "
            f"{', '.join(f'{x:.2f}' for x in oh)} | {statistics.median(oh):.2f} | "
            f"{', '.join(f'{x:.0f}' for x in cpu)} | {statistics.median(cpu):.0f} |"
        )
    on = statistics.median(x["tps"] for x in rows["on"])
    off = statistics.median(x["tps"] for x in rows["off"])
    cpu_on = statistics.median(x["cpu_us"] for x in rows["on"])
    cpu_off = statistics.median(x["cpu_us"] for x in rows["off"])
    print(f"tok/s on / off: {on / off:.3f}; CPU per token on / off: {cpu_on / cpu_off:.3f}")


if __name__ == "__main__":
    sys.exit(main())
