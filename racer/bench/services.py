"""Benchmarks of the distributed pipeline (scripts that print tables, not tests).

``racer bench-stack``: the same prompts in this process (the engine) and through the gateway of a
local stack (three processes), interleaved prompt by prompt; tokens/s side by side, outputs
compared, and the per-round orchestration overhead (round wall time minus the drafter's and the
verifier's own time).

``racer bench-snapshot``: size and save/restore time of a full drafter session's snapshot, in
memory and through a store (Redis when given a URL).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass

from ..stats import percentile
from .harness import table


@dataclass
class Side:
    """One prompt's answer on one side of ``bench-stack``; times per round in ms."""

    out: list[int]
    secs: float
    rounds: int
    verify_ms: float  # in process: the engine's verify calls; through the gateway: the verifier's own time
    draft_ms: float  # likewise, the drafter's
    overhead_ms: float | None = None  # through the gateway: round wall time minus the drafter's and verifier's

    @property
    def tps(self) -> float:
        return len(self.out) / self.secs


def _in_process(engine, ids: list[int], args) -> Side:
    from .modes import run_engine

    out, secs, st, _ = run_engine(engine, ids, args.mode, args.budget, args.max_new_tokens)
    rounds = max(1, st.rounds)
    return Side(out, secs, st.rounds, st.verify_s * 1e3 / rounds, st.draft_s * 1e3 / rounds)


def _through_gateway(c, ids: list[int], args) -> Side:
    t0 = time.perf_counter()
    out, _, last = c.complete(ids, max_new_tokens=args.max_new_tokens, mode=args.mode, budget=args.budget)
    secs = time.perf_counter() - t0
    c.close_session(last.session_id)
    s = last.stats
    rounds = max(1, s.rounds)
    overhead = (s.total_ms - s.prefill_ms - s.draft_ms - s.verify_ms) / rounds
    return Side(out, secs, s.rounds, s.verify_ms / rounds, s.draft_ms / rounds, overhead)


@dataclass
class StackRow:
    category: str
    local: Side
    stack: Side

    @property
    def ratio(self) -> float:
        return self.stack.tps / self.local.tps

    @property
    def same(self) -> bool:
        return self.local.out == self.stack.out


def _stack_table(rows: list[StackRow], args, engine_threads: int) -> str:
    lines = [
        f"mode={args.mode} C={args.budget} prompts={len(rows)} max_new_tokens={args.max_new_tokens} "
        f"in-process threads={engine_threads}",
        # verify and draft: ms per round on each side (in process: the engine's calls; through the
        # gateway: what the verifier and the drafter report as their own time for the round).
        "| prompt | category | tokens | rounds in-process / gateway | in-process tok/s | gateway tok/s | ratio | "
        "verify ms/round in-process / verifier | draft ms/round in-process / drafter | overhead/round ms | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        lo, st = r.local, r.stack
        lines.append(
            f"| {i} | {r.category} | {len(st.out)} | {lo.rounds} / {st.rounds} | {lo.tps:.2f} | {st.tps:.2f} "
            f"| {r.ratio:.3f} | {lo.verify_ms:.1f} / {st.verify_ms:.1f} | {lo.draft_ms:.2f} / {st.draft_ms:.2f} | "
            f"{st.overhead_ms:.2f} | {'yes' if r.same else 'NO'} |"
        )

    def med(f) -> float:
        return statistics.median(f(r) for r in rows)

    lines.append(
        f"| median | | | | {med(lambda r: r.local.tps):.2f} | {med(lambda r: r.stack.tps):.2f} "
        f"| {med(lambda r: r.ratio):.3f} | {med(lambda r: r.local.verify_ms):.1f} / "
        f"{med(lambda r: r.stack.verify_ms):.1f} | {med(lambda r: r.local.draft_ms):.2f} / "
        f"{med(lambda r: r.stack.draft_ms):.2f} | {med(lambda r: r.stack.overhead_ms):.2f} "
        f"| {sum(r.same for r in rows)}/{len(rows)} |"
    )
    return "\n".join(lines)


def bench_stack(args) -> int:
    import grpc
    import torch
    from tqdm import tqdm

    from common import cpus
    from common.text import prompt_ids
    from common.v1 import verifier_pb2 as vpb
    from common.v1 import verifier_pb2_grpc as vpb_grpc
    from gateway.turn_links import ROUND_OVERHEAD_MS

    from .. import stack
    from ..client import Client
    from ..inprocess import InProcessStack
    from ..prompts import DEFAULT_PROMPTS, load_spec_bench
    from .modes import run_engine

    prompts = load_spec_bench(args.prompts or DEFAULT_PROMPTS, args.per_category)
    engine = InProcessStack.load(args.model, dtype=args.dtype)
    engine.overhead_ms = ROUND_OVERHEAD_MS  # what the gateway tells its drafters: the same budget choices
    rows: list[StackRow] = []

    def same_costs(stub) -> None:
        # Both sides choose their budgets from the verifier's current cost curve, so they draft the
        # same trees and the ratio measures the pipeline, not two noisy measurements of one curve.
        if args.budget == 0:
            curve = stub.Stats(vpb.VerifierStatsRequest(), timeout=30, metadata=stack.internal_metadata()).cost
            engine.costs = dict(zip(curve.sizes, curve.ms))

    with (
        stack.running(args.model, args.port_base, args.metrics_base, pin=args.pin, dtype=args.dtype) as gateway,
        Client(gateway, api_key=stack.client_key(), timeout=600) as c,
        grpc.insecure_channel(stack.target("verifier", args.port_base)) as vch,
    ):
        verifier = vpb_grpc.VerifierStub(vch)
        # As many torch threads as this thread's CPUs: with the verifier pinned, the engine shares
        # what is left (torch counted every CPU when it was imported, before the pinning).
        engine_threads = len(cpus.available())
        torch.set_num_threads(engine_threads)
        warm = prompt_ids(engine.tokenizer, "Hello", args.system)
        same_costs(verifier)
        run_engine(engine, warm, args.mode, args.budget, 4)
        c.complete(warm, max_new_tokens=4, mode=args.mode, budget=args.budget)
        for p in tqdm(prompts, file=sys.stderr, unit="prompt"):
            ids = prompt_ids(engine.tokenizer, p.text, args.system)
            same_costs(verifier)
            if len(rows) % 2 == 0:  # interleaved: each side goes first every other prompt
                local, through = _in_process(engine, ids, args), _through_gateway(c, ids, args)
            else:
                through = _through_gateway(c, ids, args)
                local = _in_process(engine, ids, args)
            rows.append(StackRow(p.category, local, through))
    print(_stack_table(rows, args, engine_threads))
    return 0 if all(r.same for r in rows) else 1


def bench_snapshot(args) -> int:
    from common.priors import load_prior
    from common.store import open_store
    from drafter.draft_session import DrafterConfig, DraftSession
    from drafter.snapshot import dumps, loads

    cfg = DrafterConfig()
    prior = load_prior("default", cfg.topk)
    rng = random.Random(0)
    # A session that fills the automaton: text-like token stream (Zipf-ish over 8k ids), 8 top-k per token.
    vocab = 8000
    weights = [1 / (i + 1) for i in range(vocab)]
    s = DraftSession(cfg, prior)
    while len(s.automaton.parent) - len(s.automaton._free) < cfg.max_nodes or len(s.history) < args.tokens:
        toks = rng.choices(range(vocab), weights, k=256)
        s.extend(toks, [rng.choices(range(vocab), weights, k=cfg.topk) for _ in toks])
    nodes = len(s.automaton.parent) - len(s.automaton._free)
    enc, dec = [], []
    data = b""
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        data = dumps(s)
        enc.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        loads(data, cfg, prior)
        dec.append((time.perf_counter() - t0) * 1e3)
    store = open_store(args.store)
    put, get = [], []

    async def io():
        for i in range(args.repeat):
            t0 = time.perf_counter()
            await store.set(f"racer:bench:snapshot:{i}", data, 60)
            put.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            got = await store.get(f"racer:bench:snapshot:{i}")
            get.append((time.perf_counter() - t0) * 1e3)
            assert got == data
            await store.delete(f"racer:bench:snapshot:{i}")
        await store.close()

    asyncio.run(io())
    print(
        f"session: {nodes} automaton nodes, {len(s.history)} tokens, {len(s.table)} copy-logit rows; "
        f"store {args.store}; {args.repeat} repeats"
    )
    steps = (
        ("encode (dumps)", enc),
        ("store write", put),
        ("store read", get),
        ("decode (loads)", dec),
        ("save = encode + write", [a + b for a, b in zip(enc, put)]),
        ("restore = read + decode", [a + b for a, b in zip(get, dec)]),
    )
    print(
        table(
            ("step", "p50 ms", "p99 ms"),
            ((name, f"{percentile(xs, 0.5):.1f}", f"{percentile(xs, 0.99):.1f}") for name, xs in steps),
        )
    )
    print(f"snapshot size: {len(data) / 1024:.0f} KiB")
    return 0


@dataclass
class BatchRow:
    n: int  # concurrent sessions
    name: str  # batched or unbatched
    tps: float  # aggregate
    latencies: list[float]  # seconds per session
    same: int  # sessions whose output equals the first output of their prompt
    done: int
    errors: int
    forwards: int = 0  # the verifier's tree forwards meanwhile (0: not read)
    rounds: int = 0  # the sessions' rounds those forwards verified


def _verifier_forwards(target) -> tuple[int, int]:
    """(tree forwards, rounds verified in them) the verifier of the stack at ``target`` has counted."""
    from ..procs import scrape

    port = getattr(target, "metrics", {}).get("verifier")
    if not port:
        return 0, 0
    got = scrape(port)
    count = got.get(("racer_verify_batch_size_count", ()), 0.0)
    return int(count), int(got.get(("racer_verify_batch_size_sum", ()), 0.0))


def _concurrent(target: str, n: int, prompts: list[str], args, reference: dict[int, list[int]]) -> BatchRow:
    """``n`` sessions at once through ``target``, one thread each; their outputs against ``reference``
    (the first output seen for each prompt, filled here)."""
    import threading

    from .. import stack
    from ..client import Client

    outs: dict[int, list[int]] = {}
    lat: list[float] = []
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            with Client(target, api_key=stack.client_key(), timeout=1800) as c:
                t0 = time.perf_counter()
                ids, _, last = c.complete(
                    prompts[i % len(prompts)],
                    max_new_tokens=args.max_new_tokens,
                    mode=args.mode,
                    budget=args.budget,
                    system=args.system,
                )
                lat.append(time.perf_counter() - t0)
                outs[i] = ids
                c.close_session(last.session_id)
        except Exception as e:  # noqa: BLE001 - counted and shown
            errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for i, ids in outs.items():
        reference.setdefault(i % len(prompts), ids)
    same = sum(1 for i, ids in outs.items() if ids == reference[i % len(prompts)])
    tokens = sum(len(v) for v in outs.values())
    return BatchRow(n, "", tokens / wall, lat, same, len(outs), len(errors))


def _batch_table(rows: list[BatchRow], args) -> str:
    cells = []
    for r in sorted(rows, key=lambda r: (r.n, r.name)):
        p50 = statistics.median(r.latencies) if r.latencies else float("nan")
        slowest = max(r.latencies) if r.latencies else float("nan")
        per = f"{r.rounds / r.forwards:.1f}" if r.forwards else "-"
        cells.append(
            (
                str(r.n),
                r.name,
                f"{r.tps:.1f}",
                f"{p50:.1f}",
                f"{slowest:.1f}",
                f"{r.same}/{r.done}",
                str(r.errors),
                str(r.forwards or "-"),
                per,
            )
        )
    head = (
        "sessions",
        "batching",
        "aggregate tok/s",
        "session latency p50 s",
        "slowest s",
        "identical",
        "errors",
        "verifier forwards",
        "rounds a forward",
    )
    lines = [
        f"mode={args.mode} budget={'auto' if args.budget == 0 else args.budget} max_new_tokens={args.max_new_tokens}",
        table(head, cells),
    ]
    one = {r.name: r.tps for r in rows if r.n == 1 and not r.errors}
    for r in rows:
        if r.n > 1 and r.name == "batched" and one.get("batched"):
            lines.append(f"{r.n} sessions batched: {r.tps / one['batched']:.2f}x one session's tok/s")
    if any(r.errors for r in rows):
        lines.append("some sessions failed (the errors column): their rows are not comparable")
    return "\n".join(lines)


def bench_batch(args) -> int:
    """N concurrent sessions through two local stacks, batching on and off, same prompts, one run."""
    from .. import stack
    from ..prompts import DEFAULT_PROMPTS, load_spec_bench

    prompts = [p.text for p in load_spec_bench(args.prompts or DEFAULT_PROMPTS, 4)]
    configs = {"batched": {"RACER_MAX_BATCH": "16"}, "unbatched": {"RACER_MAX_BATCH": "1"}}
    reference: dict[int, list[int]] = {}
    rows: list[BatchRow] = []
    with (
        stack.running(
            args.model, args.port_base, args.metrics_base, env=configs["batched"], pin=args.pin, dtype=args.dtype
        ) as g_on,
        stack.running(
            args.model,
            args.port_base + 10,
            args.metrics_base + 10,
            env=configs["unbatched"],
            pin=args.pin,
            dtype=args.dtype,
        ) as g_off,
    ):
        targets = {"batched": g_on, "unbatched": g_off}
        for n in args.sessions:
            for name in ("batched", "unbatched") if len(rows) % 2 == 0 else ("unbatched", "batched"):
                before = _verifier_forwards(targets[name])
                row = _concurrent(targets[name], n, prompts, args, reference)
                after = _verifier_forwards(targets[name])
                row.name, row.forwards, row.rounds = name, after[0] - before[0], after[1] - before[1]
                rows.append(row)
                print(f"{name:9s} sessions={n:2d} tok/s={row.tps:6.1f} errors={row.errors}", file=sys.stderr)
    print(_batch_table(rows, args))
    return 0
