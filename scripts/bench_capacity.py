"""The verifier under more KV memory than it has, and under one tenant's long prompts.

Starts ``racer serve verifier`` as its own process (the default model unless ``--model``) and
talks to it over gRPC, as a gateway would:

* **memory**: ``--sessions`` concurrent sessions, each a ``--prompt-tokens`` random prompt then
  ``--new-tokens`` greedy tokens (one-node trees), against ``--budget-sessions`` sessions' worth of
  KV budget. Peak RSS of the verifier (/proc, sampled every 20 ms) against its RSS when idle (model and
  runtime) plus the budget; every turn completes (after waiting for room) or gets a clear status;
  the outputs are compared with ``model.generate`` greedy in this process.
* **fairness**: tenant B opens short prompts one after another and measures its time to first token
  (the open's answer), alone and while tenant A keeps ``--a-sessions`` long prompts in flight.

The full case of the capacity test (24 x 8,000 tokens against a 2 GiB budget; hours on 2 cores):

    PYTHONPATH=. python scripts/bench_capacity.py --sessions 24 --prompt-tokens 8000 --budget-bytes 2147483648

Scaled down for a small machine (the default): 8 x 2,000 tokens, a budget that holds 3 of them.

    PYTHONPATH=. python scripts/bench_capacity.py [--threads 2] [--skip-fairness] [--skip-memory]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from common.health import wait_serving  # noqa: E402
from common.v1 import verifier_pb2 as vpb  # noqa: E402
from common.v1 import verifier_pb2_grpc as vgrpc  # noqa: E402
from racer.procs import socket_dir  # noqa: E402

HEADROOM = 320  # --kv-headroom-tokens default: rows an open reserves past its history


def spawn(args, budget: int, chunk: int) -> tuple[subprocess.Popen, str]:
    target = f"unix:{socket_dir() / f'verifier-{budget}-{chunk}.sock'}"  # an address nothing else can take
    cmd = [
        sys.executable,
        "-m",
        "racer.cli",
        "serve",
        "verifier",
        "--host",
        target,
        "--metrics-port",
        "0",
        "--measure-cost",
        "0",
        "--model",
        args.model,
        "--threads",
        str(args.threads),
        "--kv-memory-bytes",
        str(budget),
        "--prefill-chunk",
        str(chunk),
        "--admission-wait-seconds",
        str(args.wait_seconds),
        "--max-sessions",
        "256",
        "--log-level",
        "WARNING",
        "--allow-unauthenticated",  # bound to loopback, called by this script alone
        "1",
    ]
    proc = subprocess.Popen(cmd, env=dict(os.environ), start_new_session=True)
    wait_serving(target, "racer.v1.Verifier", timeout=600, alive=lambda: proc.poll() is None, what="verifier")
    return proc, target


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def turn(stub, tenant: str, sid: str, prompt: list[int], new_tokens: int) -> tuple[str, list[int], float]:
    """One session's turn: (status name, greedy tokens, seconds to the first token)."""
    call = stub.Session()
    t0 = time.perf_counter()
    out: list[int] = []
    ttft = float("nan")
    try:
        await call.write(vpb.VerifyRequest(open=vpb.VerifierOpen(session_id=sid, tenant=tenant, history=prompt)))
        resp = await call.read()
        if resp is grpc.aio.EOF:
            return (await call.code()).name, out, ttft
        ttft = time.perf_counter() - t0
        out.append(resp.next_token)
        for _ in range(new_tokens - 1):
            await call.write(vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[out[-1]], parents=[-1])))
            resp = await call.read()
            if resp is grpc.aio.EOF:
                return (await call.code()).name, out, ttft
            out.append(resp.next_token)
        await call.done_writing()
        return "OK", out, ttft
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}", out, ttft


async def drop(stub, tenant: str, sid: str) -> None:
    await stub.Drop(vpb.VerifierDropRequest(tenant=tenant, session_id=sid))


def rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (Linux: /proc/PID/statm, in pages)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    def __init__(self, pid: int):
        self.pid = pid
        self.peak = rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss(self.pid))

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def reference(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from racer.bench.reference import hf_greedy

    return [hf_greedy(model, p, new_tokens) for p in prompts]


def memory_case(args, model, per_token: int) -> None:
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.sessions)]
    one = (args.prompt_tokens + HEADROOM) * per_token
    budget = args.budget_bytes or int(args.budget_sessions * one)
    proc, target = spawn(args, budget, args.prefill_chunk)
    try:

        async def warm():  # the weights paged in, the allocator's first arenas: part of "idle"
            async with grpc.aio.insecure_channel(target) as ch:
                stub = vgrpc.VerifierStub(ch)
                await turn(stub, "w", "warm", prompts[0][: args.prefill_chunk], 2)
                await drop(stub, "w", "warm")

        asyncio.run(warm())
        idle = rss(proc.pid)
        sampler = RssSampler(proc.pid)

        async def go():
            async with grpc.aio.insecure_channel(target) as ch:
                stub = vgrpc.VerifierStub(ch)
                t0 = time.perf_counter()

                async def one_session(i):
                    res = await turn(stub, "t", f"m{i}", prompts[i], args.new_tokens)
                    await drop(stub, "t", f"m{i}")  # CloseSession: the next waiter gets its memory
                    return res

                res = await asyncio.gather(*(one_session(i) for i in range(args.sessions)))
                return res, time.perf_counter() - t0

        results, wall = asyncio.run(go())
        peak = sampler.close()
    finally:
        stop(proc)
    t0 = time.perf_counter()
    want = reference(model, prompts, args.new_tokens)
    ref_s = time.perf_counter() - t0
    ok = [r for r in results if r[0] == "OK"]
    same = sum(1 for r, w in zip(results, want) if r[0] == "OK" and r[1] == w)
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r[0]] = statuses.get(r[0], 0) + 1
    mib = 1 << 20
    print(
        f"\n## memory: {args.sessions} concurrent x {args.prompt_tokens} tokens + {args.new_tokens} new, "
        f"{args.threads} threads"
    )
    print("| KV per token | session reserve | budget | idle RSS | peak RSS | peak - idle | peak - idle - budget |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {per_token} B | {one / mib:.0f} MiB | {budget / mib:.0f} MiB ({budget / one:.1f} sessions) "
        f"| {idle / mib:.0f} MiB | {peak / mib:.0f} MiB | {(peak - idle) / mib:.0f} MiB "
        f"| {(peak - idle - budget) / mib:+.0f} MiB |"
    )
    print(
        f"\nturns: {len(ok)}/{len(results)} OK in {wall:.1f} s; statuses {statuses}; "
        f"identical to model.generate greedy: {same}/{len(ok)} (reference took {ref_s:.0f} s)"
    )


def fairness_case(args, model, per_token: int, chunk: int, b_turns: int) -> dict:
    rng = random.Random(1)
    vocab = model.config.vocab_size
    budget = (args.a_sessions + 2) * (args.a_tokens + HEADROOM) * per_token
    proc, target = spawn(args, budget, chunk)

    def p(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    try:

        async def b_series(stub, tag):
            ttft = []
            for i in range(b_turns):
                status, _, t = await turn(stub, "B", f"b{tag}{i}", p(args.b_tokens), 1)
                assert status == "OK", status
                ttft.append(t)
                await drop(stub, "B", f"b{tag}{i}")
            return ttft

        async def go():
            async with grpc.aio.insecure_channel(target) as ch:
                stub = vgrpc.VerifierStub(ch)
                await turn(stub, "W", "warm", p(args.b_tokens), 1)  # first-call costs
                alone = await b_series(stub, "alone")
                stop_a = asyncio.Event()
                a_done = 0

                async def a_worker(w):
                    nonlocal a_done
                    i = 0
                    while not stop_a.is_set():
                        status, _, _ = await turn(stub, "A", f"a{w}-{i}", p(args.a_tokens), 1)
                        assert status == "OK", status
                        await drop(stub, "A", f"a{w}-{i}")
                        a_done += 1
                        i += 1

                workers = [asyncio.ensure_future(a_worker(w)) for w in range(args.a_sessions)]
                loaded = await b_series(stub, "loaded")
                stop_a.set()
                await asyncio.gather(*workers)
                return alone, loaded, a_done

        alone, loaded, a_done = asyncio.run(go())
    finally:
        stop(proc)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] * 1e3

    return dict(
        chunk=chunk,
        turns=b_turns,
        alone=(pct(alone, 0.5), pct(alone, 0.99)),
        loaded=(pct(loaded, 0.5), pct(loaded, 0.99)),
        a_done=a_done,
        mean_loaded=statistics.mean(loaded) * 1e3,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--budget-sessions", type=float, default=3.0, help="budget in sessions' reservations")
    ap.add_argument("--budget-bytes", type=int, default=0, help="budget in bytes (overrides --budget-sessions)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--wait-seconds", type=float, default=3600.0, help="the verifier's --admission-wait-seconds")
    ap.add_argument("--a-sessions", type=int, default=8)
    ap.add_argument("--a-tokens", type=int, default=2048)
    ap.add_argument("--b-tokens", type=int, default=32)
    ap.add_argument("--b-turns", type=int, default=20)
    ap.add_argument("--baseline-turns", type=int, default=10, help="B's turns in the unchunked comparison")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-fairness", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from verifier.gguf_blocks import cache_dtype
    from verifier.kv_memory import kv_bytes_per_token
    from verifier.model import load

    torch.set_num_threads(args.threads)
    model = load(args.model, tokenizer=False).model
    per_token = kv_bytes_per_token(model.config, cache_dtype(model).itemsize)
    if not args.skip_memory:
        memory_case(args, model, per_token)
    if not args.skip_fairness:
        print(
            f"\n## fairness: B's time to first token ({args.b_tokens}-token prompts), alone "
            f"and with A's {args.a_sessions} concurrent {args.a_tokens}-token prompts, {args.threads} threads"
        )
        print("| prefill chunk | B turns | B alone p50 / p99 | B with A p50 / p99 | p99 ratio | A done meanwhile |")
        print("|---|---|---|---|---|---|")
        # Then unchunked: a chunk (and a tenant's turn) is a whole A prompt, so B waits for up to one
        # of them. (First come, first served would make it wait for all of A's queued prompts.)
        for chunk, turns in ((args.prefill_chunk, args.b_turns), (args.a_tokens, args.baseline_turns)):
            r = fairness_case(args, model, per_token, chunk, turns)
            name = str(chunk) if chunk < args.a_tokens else f"{chunk} (A's whole prompts)"
            print(
                f"| {name} | {turns} | {r['alone'][0]:.0f} / {r['alone'][1]:.0f} ms | {r['loaded'][0]:.0f} / "
                f"{r['loaded'][1]:.0f} ms | {r['loaded'][1] / r['alone'][1]:.1f}x | {r['a_done']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
