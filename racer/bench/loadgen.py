"""``racer load``: N concurrent sessions x T turns through a gateway on this machine.

Bounded on purpose: loopback targets only, at most ``MAX_SESSIONS`` sessions, ``MAX_TURNS`` turns and
``MAX_SECONDS`` seconds (a turn still running then is cancelled and counted as an error). Prompts come
from a fixed seed, so two runs send the same requests. Reports time to first token, inter-token
latency (a chunk of k tokens that came g ms after the previous one counts k gaps of g/k ms), turn
latency, aggregate tokens/s, errors by status, refusals (RESOURCE_EXHAUSTED) and the turns that waited
for a slot of their tenant on the gateway, with their waits; sessions are closed at the end unless asked not to.

Several gateways (``--target a,b``): turn t of session i goes to gateway (i + t) mod n, so every
session moves between replicas. Several API keys (``--api-key k1,k2``): session i belongs to tenant
i mod k, and errors are also counted per tenant (``tenant1``, ``tenant2``...: keys are not printed).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import socket
import time
from dataclasses import asdict, dataclass, field

import grpc

from common.v1 import generation_pb2 as pb
from common.v1 import generation_pb2_grpc as pb_grpc
from gateway.admission import QUEUE_WAIT_HEADER

from ..stats import percentile

MAX_SESSIONS = 256
MAX_TURNS = 32
MAX_NEW_TOKENS = 1024
MAX_SECONDS = 600.0

TOPICS = [
    "the tides",
    "binary search",
    "photosynthesis",
    "a bicycle gear",
    "compound interest",
    "the water cycle",
    "public-key cryptography",
    "a hash table",
    "volcanoes",
    "the Fibonacci numbers",
    "a sourdough starter",
    "TCP handshakes",
    "the moon's phases",
    "garbage collection",
    "rainbows",
    "a bloom filter",
]
ASKS = [
    "Explain {} in two sentences.",
    "Give three facts about {}.",
    "What is a common misconception about {}?",
    "Summarize {} for a ten-year-old.",
    "Write a haiku about {}.",
    "List the steps of {} briefly.",
]


@dataclass
class Turn:
    prompt: str | list[int]
    ids: list[int] = field(default_factory=list)
    error: str = ""  # "" when the turn completed: otherwise "CODE: details"
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    queue_ms: float = 0.0  # how long it waited for a slot of its tenant (the gateway says)


@dataclass
class SessionRun:
    session_id: str = ""
    turns: list[Turn] = field(default_factory=list)
    tenant: int = 0  # index of its API key


@dataclass
class Report:
    sessions: int
    turns: int
    completed_turns: int
    errors: dict[str, int]
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    turn_ms: dict[str, float]
    refused: int = 0  # turns refused for want of room: RESOURCE_EXHAUSTED
    queued_turns: int = 0  # turns that waited for a slot of their tenant
    queue_ms: dict[str, float] = field(default_factory=dict)  # those waits
    runs: list[SessionRun] = field(default_factory=list, repr=False)
    tenant_errors: dict[str, dict[str, int]] = field(default_factory=dict)  # with several API keys

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("runs")
        return d

    def format(self) -> str:
        e = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        return (
            f"{self.sessions} sessions x {self.turns} turns: {self.completed_turns}/{self.sessions * self.turns} turns "
            f"completed, errors: {e}\n"
            + "".join(
                f"  {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(errs.items())) + "\n"
                for name, errs in sorted(self.tenant_errors.items())
            )
            + f"tokens {self.tokens} in {self.wall_s:.2f} s: {self.tokens_per_s:.1f} tok/s aggregate\n"
            f"time to first token  p50 {self.ttft_ms['p50']:.1f} ms  p99 {self.ttft_ms['p99']:.1f} ms\n"
            f"inter-token latency  p50 {self.itl_ms['p50']:.2f} ms  p99 {self.itl_ms['p99']:.2f} ms\n"
            f"turn latency         p50 {self.turn_ms['p50']:.1f} ms  p99 {self.turn_ms['p99']:.1f} ms\n"
            f"refused {self.refused}, queued {self.queued_turns}"
            + (
                f": queue wait p50 {self.queue_ms['p50']:.1f} ms  p99 {self.queue_ms['p99']:.1f} ms"
                if self.queued_turns
                else ""
            )
        )


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    return {"p50": percentile(xs, 0.50), "p99": percentile(xs, 0.99), "max": max(xs)}


def check_loopback(target: str) -> None:
    """Refuses a target that is not this machine: a load test is not a way to flood a service."""
    host = target.rsplit(":", 1)[0].strip("[]") if ":" in target else target
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as e:
        raise ValueError(f"--target {target!r}: cannot resolve {host!r}: {e}") from None
    bad = [a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if not addrs or bad:
        raise ValueError(f"--target {target!r}: racer load only runs against loopback addresses (got {sorted(addrs)})")


def make_prompts(sessions: int, turns: int, seed: int, ids_vocab: int = 0, prompt_tokens: int = 16) -> list[list]:
    """prompts[s][t]: text, or ``prompt_tokens`` random ids below ``ids_vocab`` (ids 0-5 are left out:
    special tokens in small vocabularies)."""
    rng = random.Random(seed)
    out = []
    for _ in range(sessions):
        if ids_vocab:
            out.append(
                [[rng.randrange(min(6, ids_vocab - 1), ids_vocab) for _ in range(prompt_tokens)] for _ in range(turns)]
            )
        else:
            out.append([rng.choice(ASKS).format(rng.choice(TOPICS)) for _ in range(turns)])
    return out


def _targets(target: str, loopback_only: bool, sessions: int, turns: int, max_new_tokens: int, time_limit: float):
    """The gateway addresses of ``target``, once every bound of the run is checked."""
    if not 1 <= sessions <= MAX_SESSIONS:
        raise ValueError(f"--sessions {sessions}: expected 1..{MAX_SESSIONS}")
    if not 1 <= turns <= MAX_TURNS:
        raise ValueError(f"--turns {turns}: expected 1..{MAX_TURNS}")
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: expected 1..{MAX_NEW_TOKENS}")
    if not 0 < time_limit <= MAX_SECONDS:
        raise ValueError(f"--time-limit {time_limit}: expected (0, {MAX_SECONDS:g}] seconds")
    targets = [t.strip() for t in target.split(",") if t.strip()]
    if not targets:
        raise ValueError("--target: no gateway address")
    if loopback_only:
        for t in targets:
            check_loopback(t)
    return targets


@dataclass
class _Samples:
    """What every turn of the run measured, in ms."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    turn: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)


async def _one_turn(stub, req: pb.GenerateRequest, metadata, run: SessionRun, turn: Turn, samples: _Samples) -> None:
    """Streams one turn's answer into ``turn``; ``grpc.aio.AioRpcError`` when the gateway refuses or fails it."""
    t0 = prev = time.perf_counter()
    call = stub.Generate(req, metadata=metadata)
    async for r in call:
        now = time.perf_counter()
        run.session_id = run.session_id or r.session_id
        if r.token_ids:
            if not turn.ids:
                turn.ttft_ms = (now - t0) * 1e3
                samples.ttft.append(turn.ttft_ms)
            else:
                gap = (now - prev) * 1e3 / len(r.token_ids)
                samples.itl.extend([gap] * len(r.token_ids))
            prev = now
            turn.ids.extend(r.token_ids)
    turn.total_ms = (time.perf_counter() - t0) * 1e3
    samples.turn.append(turn.total_ms)
    waited = dict(await call.initial_metadata()).get(QUEUE_WAIT_HEADER)
    if waited is not None:  # the turn waited for a slot of its tenant on the gateway
        turn.queue_ms = float(waited)
        samples.queue.append(turn.queue_ms)


async def _one_session(i: int, run: SessionRun, prompts: list, stubs, metadata, speculation, max_new_tokens, samples):
    """Session ``i``'s turns in order, turn ``t`` through gateway ``(i + t) mod n``; stops at its first error."""
    for t, p in enumerate(prompts):
        turn = Turn(p)
        run.turns.append(turn)
        req = pb.GenerateRequest(session_id=run.session_id, max_new_tokens=max_new_tokens, speculation=speculation)
        if isinstance(p, str):
            req.prompt = p
        else:
            req.prompt_ids.ids.extend(p)
        try:
            await _one_turn(stubs[(i + t) % len(stubs)], req, metadata, run, turn, samples)
        except grpc.aio.AioRpcError as e:
            turn.error = f"{e.code().name}: {e.details()}"
            return  # the session's later turns would build on a turn that did not happen
        except asyncio.CancelledError:
            turn.error = "TIME_LIMIT: the run's time limit passed"
            raise


def _errors(runs: list[SessionRun], tenants: int) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Failed turns by status code, overall and (with several tenants) per tenant."""
    errors: dict[str, int] = {}
    tenant_errors: dict[str, dict[str, int]] = {}
    for r in runs:
        for t in r.turns:
            if t.error:
                code = t.error.split(":", 1)[0]
                errors[code] = errors.get(code, 0) + 1
                if tenants > 1:
                    per = tenant_errors.setdefault(f"tenant{r.tenant + 1}", {})
                    per[code] = per.get(code, 0) + 1
    return errors, tenant_errors


def _report(runs: list[SessionRun], tenants: int, samples: _Samples, wall: float, turns: int) -> Report:
    errors, tenant_errors = _errors(runs, tenants)
    tokens = sum(len(t.ids) for r in runs for t in r.turns)
    return Report(
        sessions=len(runs),
        turns=turns,
        completed_turns=sum(1 for r in runs for t in r.turns if not t.error),
        errors=errors,
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall else 0.0,
        ttft_ms=percentiles(samples.ttft),
        itl_ms=percentiles(samples.itl),
        turn_ms=percentiles(samples.turn),
        refused=errors.get("RESOURCE_EXHAUSTED", 0),
        queued_turns=len(samples.queue),
        queue_ms=percentiles(samples.queue),
        runs=runs,
        tenant_errors=tenant_errors,
    )


async def run_load(
    target: str,
    sessions: int = 8,
    turns: int = 3,
    max_new_tokens: int = 64,
    *,
    seed: int = 0,
    ids_vocab: int = 0,
    prompt_tokens: int = 16,
    time_limit: float = 120.0,
    api_key: str | None = None,
    mode: str = "",
    budget: int = 0,
    close: bool = True,
    credentials: grpc.ChannelCredentials | None = None,
    loopback_only: bool = True,
) -> Report:
    targets = _targets(target, loopback_only, sessions, turns, max_new_tokens, time_limit)
    prompts = make_prompts(sessions, turns, seed, ids_vocab, prompt_tokens)
    keys = [k.strip() for k in api_key.split(",")] if api_key else [""]
    mds = [(("authorization", f"Bearer {k}"),) if k else () for k in keys]
    runs = [SessionRun(tenant=i % len(keys)) for i in range(sessions)]
    samples = _Samples()
    speculation = pb.Speculation(mode=mode, budget=budget)
    opts = [("grpc.max_receive_message_length", 64 << 20)]
    channels = [
        grpc.aio.secure_channel(t, credentials, opts) if credentials else grpc.aio.insecure_channel(t, opts)
        for t in targets
    ]
    stubs = [pb_grpc.GenerationStub(ch) for ch in channels]
    t_start = time.perf_counter()
    tasks = [
        asyncio.ensure_future(
            _one_session(i, r, prompts[i], stubs, mds[r.tenant], speculation, max_new_tokens, samples)
        )
        for i, r in enumerate(runs)
    ]
    try:
        _, pending = await asyncio.wait(tasks, timeout=time_limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - t_start
        if close:
            await asyncio.gather(
                *(
                    stubs[i % len(stubs)].CloseSession(
                        pb.SessionRef(session_id=r.session_id), metadata=mds[r.tenant], timeout=10
                    )
                    for i, r in enumerate(runs)
                    if r.session_id
                ),
                return_exceptions=True,
            )
    finally:
        for ch in channels:
            await ch.close()
    return _report(runs, len(keys), samples, wall, turns)


def main(args) -> int:
    from common.tls import channel_credentials

    creds = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key, system_roots=bool(args.tls_cert))
    report = asyncio.run(
        run_load(
            args.target,
            sessions=args.sessions,
            turns=args.turns,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            ids_vocab=args.ids,
            prompt_tokens=args.prompt_tokens,
            time_limit=args.time_limit,
            api_key=args.api_key or os.environ.get("RACER_API_KEY"),
            mode=args.mode,
            budget=args.budget,
            close=not args.keep_sessions,
            credentials=creds,
        )
    )
    print(report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.summary(), f, indent=2)
    return 0 if not report.errors else 1
