"""``racer soak``: mixed load for a bounded time while services fail, then what was answered, lost
and changed, and how much memory each service held over time.

The stack runs as processes (``racer.procs``): a ``redis-server`` with an append-only file, two
verifiers, two drafters and a gateway with the OpenAI HTTP API. Client threads, until ``--minutes``
have passed, each pick one of:

* a conversation over gRPC: a kept session, its turns one after another, then closed;
* a burst of one-call streaming chat requests through the OpenAI API, all at once;
* a hang-up: a streaming turn whose client goes away after its first chunk.

Meanwhile a drafter is killed (SIGKILL) and restarted, then a verifier, then Redis, which comes back
from its append-only file. Every answer is greedy, so each is compared with the same request's
answer in a pass before the faults ("identical"); a turn that failed is counted with its status,
and its conversation stops there (its history is not the reference's any more). Each service's
resident memory is sampled every ``--sample-seconds``.

Bounded: the run ends at ``--minutes`` (turns in flight finish), each request has a timeout, and
every process started is stopped.
"""

from __future__ import annotations

import random
import secrets
import statistics
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

QUESTIONS = [
    "Name three primary colors.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "List four planets of the solar system.",
    "How do you boil an egg?",
    "Give two synonyms for happy.",
    "What does a compiler do?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
    "Suggest a name for a bakery.",
    "What is 12 times 12?",
]
FOLLOW_UPS = ["Say it in fewer words.", "Now give one more example.", "Why?"]
# The conversations the clients hold: a question and zero to three follow-ups.
CONVERSATIONS = [[q, *FOLLOW_UPS[: i % 4]] for i, q in enumerate(QUESTIONS[:8])]


@dataclass
class Tally:
    answered: int = 0  # turns whose answer came whole
    identical: int = 0  # of which equal to the reference
    changed: list = field(default_factory=list)  # (what, expected, got)
    failed: Counter = field(default_factory=Counter)  # status -> turns
    hung_up: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, what: str, expected, got) -> None:
        with self.lock:
            self.answered += 1
            if expected == got:
                self.identical += 1
            else:
                self.changed.append((what, expected, got))

    def fail(self, status: str) -> None:
        with self.lock:
            self.failed[status] += 1


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def shared_settings(args, token: str) -> dict[str, str]:
    """The settings every service of the soak gets (``racer.procs.Service`` passes on no other
    ``RACER_*`` variable): ``--model`` and ``--dtype`` as the command resolved them (the flag, else
    ``RACER_MODEL`` / ``RACER_DTYPE``, else the table's default)."""
    base = dict(RACER_INTERNAL_TOKEN=token, RACER_LOG_LEVEL="WARNING", RACER_MODEL=args.model, RACER_DTYPE=args.dtype)
    if args.model != "default":
        base["RACER_PRIOR"] = "none"
    return base


class Soak:
    def __init__(self, args, workdir: Path):
        from .procs import RedisServer

        self.args = args
        self.redis = RedisServer(workdir / "redis").start()
        self.services: list = []  # each service once it is made (close stops the started ones)
        try:
            self._start(workdir)
        except BaseException:
            self.close()  # what started, and Redis
            raise
        self.memory: list[tuple[float, str, float]] = []  # (seconds, service, MiB)
        self.faults: list[tuple[float, str]] = []

    def _start(self, workdir: Path) -> None:
        from .exits import wait_healthy
        from .procs import Service

        base = shared_settings(self.args, secrets.token_urlsafe(32))
        verifier = dict(base, RACER_THREADS="1", OMP_NUM_THREADS="1")
        drafter = dict(base, RACER_SNAPSHOT_URL=self.redis.url)
        self.verifiers = [Service("verifier", verifier, workdir, f"verifier{i}") for i in range(2)]
        self.drafters = [Service("drafter", drafter, workdir, f"drafter{i}") for i in range(2)]
        gateway = dict(
            base,
            RACER_SESSION_URL=self.redis.url,
            RACER_DRAFTERS=",".join(d.target for d in self.drafters),
            RACER_VERIFIERS=",".join(v.target for v in self.verifiers),
            RACER_HTTP_PORT="-1",
            RACER_STORE_RETRY_SECONDS="60",
        )
        self.gateway = Service("gateway", gateway, workdir, "gateway")
        self.services = [*self.verifiers, *self.drafters, self.gateway]
        for s in self.verifiers:  # one at a time: each measures its kernels at start-up
            wait_healthy(s.start(), 900)
        for s in [*self.drafters, self.gateway]:
            s.start()
        for s in [*self.drafters, self.gateway]:
            wait_healthy(s)
        self.target = self.gateway.target
        self.url = f"http://127.0.0.1:{self.gateway.http_port}/v1"

    def close(self) -> None:
        for s in self.services:
            s.terminate()
        self.redis.stop()

    # -- the load ------------------------------------------------------------------------------
    def run_conversation(self, turns: list[str], tally: Tally | None, reference: dict) -> None:
        import grpc

        from .client import Client

        key = tuple(turns)
        with Client(self.target, timeout=300) as c:
            sid = ""
            for i, text in enumerate(turns):
                try:
                    ids, _, last = c.complete(text, session_id=sid, max_new_tokens=self.args.max_new_tokens)
                except grpc.RpcError as e:
                    if tally is None:
                        raise RuntimeError(f"the reference pass failed: {e.code().name}: {e.details()}") from None
                    tally.fail(f"grpc {e.code().name}")
                    return
                sid = last.session_id
                if tally is None:
                    reference[(key, i)] = ids
                else:
                    tally.answer(f"conversation turn {i}", reference.get((key, i)), ids)
            try:
                c.close_session(sid)
            except grpc.RpcError as e:
                if tally is not None:
                    tally.fail(f"close {e.code().name}")

    def one_call(self, question: str) -> tuple[str | None, str | None]:
        """(answer, None) or (None, the error's status)."""
        import openai

        with openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=300) as c:
            try:
                messages = [{"role": "user", "content": question}]
                r = c.chat.completions.create(
                    model="SmolLM2-135M-Instruct" if self.args.model == "default" else Path(self.args.model).name,
                    messages=messages,
                    stream=True,
                    max_tokens=self.args.max_new_tokens,
                    temperature=0,
                )
                return "".join(ch.choices[0].delta.content or "" for ch in r), None
            except openai.APIStatusError as e:
                return None, f"http {e.status_code}"
            except openai.APIError as e:
                return None, f"http {type(e).__name__}"

    def burst(self, rng: random.Random, tally: Tally | None, reference: dict) -> None:
        qs = [rng.choice(QUESTIONS) for _ in range(self.args.burst)]
        with ThreadPoolExecutor(len(qs)) as pool:
            for q, (answer, error) in zip(qs, pool.map(self.one_call, qs)):
                if tally is None:
                    if answer is not None:
                        reference[("one-call", q)] = answer
                elif error is not None:
                    tally.fail(error)
                else:
                    tally.answer("one-call", reference.get(("one-call", q)), answer)

    def hang_up(self, rng: random.Random, tally: Tally) -> None:
        import grpc

        from .client import Client

        with Client(self.target, timeout=300) as c:
            call = c.generate(rng.choice(QUESTIONS), max_new_tokens=self.args.max_new_tokens)
            try:
                next(call)
            except (grpc.RpcError, StopIteration):
                pass
            call.cancel()
        with tally.lock:
            tally.hung_up += 1

    def references(self) -> dict:
        """Every conversation and one-call question answered once, before any fault."""
        reference: dict = {}
        for turns in CONVERSATIONS:
            self.run_conversation(turns, None, reference)
        for q in QUESTIONS:
            answer, error = self.one_call(q)
            if error is not None:
                raise RuntimeError(f"the reference pass failed: {error}")
            reference[("one-call", q)] = answer
        return reference

    # -- the run ---------------------------------------------------------------------------------
    def sample_memory(self, t0: float, stop: threading.Event) -> None:
        procs = {s.name: s for s in self.services}
        while True:
            t = time.monotonic() - t0
            for name, s in procs.items():
                if s.alive():
                    mib = _rss_mib(s.proc.pid)
                    if mib is not None:
                        self.memory.append((t, name, mib))
            if self.redis.alive():
                mib = _rss_mib(self.redis.proc.pid)
                if mib is not None:
                    self.memory.append((t, "redis", mib))
            if stop.wait(self.args.sample_seconds):
                return

    def inject_faults(self, t0: float, seconds: float, stop: threading.Event) -> None:
        import signal

        plan = [
            (0.2, "drafter0 killed and restarted", self.drafters[0]),
            (0.45, "verifier0 killed and restarted", self.verifiers[0]),
            (0.7, "redis killed and restarted from its append-only file", None),
        ]
        for frac, what, svc in plan:
            if stop.wait(max(0.0, t0 + frac * seconds - time.monotonic())):
                return
            if svc is None:
                self.redis.kill()
                self.redis.start()
            else:
                svc.signal(signal.SIGKILL)
                svc.wait_exit(30)
                svc.start().wait_healthy(900)
            self.faults.append((time.monotonic() - t0, what))

    def run(self) -> Tally:
        reference = self.references()
        seconds = self.args.minutes * 60
        tally = Tally()
        stop = threading.Event()
        t0 = time.monotonic()
        threads = [
            threading.Thread(target=self.sample_memory, args=(t0, stop), daemon=True),
            threading.Thread(target=self.inject_faults, args=(t0, seconds, stop), daemon=True),
        ]
        for t in threads:
            t.start()

        def client(i: int) -> None:
            rng = random.Random(self.args.seed * 1000 + i)
            while time.monotonic() - t0 < seconds:
                kind = rng.choices(("conversation", "burst", "hang-up"), weights=(6, 2, 1))[0]
                if kind == "conversation":
                    self.run_conversation(rng.choice(CONVERSATIONS), tally, reference)
                elif kind == "burst":
                    self.burst(rng, tally, reference)
                else:
                    self.hang_up(rng, tally)

        with ThreadPoolExecutor(self.args.clients) as pool:
            list(pool.map(client, range(self.args.clients)))
        stop.set()
        for t in threads:
            t.join(900)
        return tally


def memory_table(memory: list[tuple[float, str, float]], seconds: float) -> list[str]:
    """Per service: resident MiB in the first, middle and last fifth of the run, and the peak."""
    out = [
        "| service | first fifth (median MiB) | middle | last fifth | peak | last / first |",
        "|---|---|---|---|---|---|",
    ]

    def fifth(rows, lo: float, hi: float) -> float:
        xs = [m for t, m in rows if lo * seconds <= t <= hi * seconds]
        return statistics.median(xs) if xs else float("nan")

    for name in sorted({n for _, n, _ in memory}):
        rows = [(t, m) for t, n, m in memory if n == name]
        first, middle, last = fifth(rows, 0.0, 0.2), fifth(rows, 0.4, 0.6), fifth(rows, 0.8, 1.01)
        peak = max(m for _, m in rows)
        out.append(f"| {name} | {first:.0f} | {middle:.0f} | {last:.0f} | {peak:.0f} | {last / first:.2f} |")
    return out


def _prefills(s) -> float:
    return s.metric("racer_prefill_latency_seconds_count")


def waves(args) -> int:
    """``--waves N``: N identical waves of ``--burst`` concurrent one-call requests, no faults; the
    verifier's resident memory, KV reservation and C heap once it is idle after each wave (after its
    heap trim: the ``racer_verifier_heap_trims_total`` counter is the sync point)."""
    from .procs import wait_for

    with tempfile.TemporaryDirectory(prefix="racer-waves-") as tmp:
        soak = Soak(args, Path(tmp))
        try:
            v = soak.verifiers  # new sessions go to the least saturated: both are measured
            questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.burst)]
            rows = []

            def state(label: str) -> None:
                for s in v:
                    rows.append(
                        (
                            label,
                            s.name,
                            _rss_mib(s.proc.pid),
                            s.metric("racer_verifier_kv_reserved_bytes") / 2**20,
                            s.metric("racer_verifier_heap_bytes") / 2**20,
                            s.metric("racer_verifier_heap_free_bytes") / 2**20,
                        )
                    )

            state("idle")
            answers = None
            for w in range(1, args.waves + 1):
                before = [(s.metric("racer_verifier_heap_trims_total"), _prefills(s)) for s in v]
                with ThreadPoolExecutor(len(questions)) as pool:
                    got = list(pool.map(soak.one_call, questions))
                answers = answers or got
                if got != answers or any(e for _, e in got):
                    print(f"wave {w}: answers differ from wave 1 or failed: {[e for _, e in got if e]}")
                    return 1
                for s, (trims, prefills) in zip(v, before):
                    if _prefills(s) > prefills:  # it worked in this wave: wait for its trim once idle
                        wait_for(
                            lambda s=s, n=trims: (
                                s.metric("racer_verifier_heap_trims_total") > n
                                and not s.metric("racer_verifier_kv_reserved_bytes")
                            ),
                            120,
                            f"{s.name} idle and trimmed after wave {w}",
                        )
                state(f"after wave {w}")
        finally:
            soak.close()
    print(f"waves: {args.waves} x {args.burst} one-call requests at once, model {args.model}, dtype {args.dtype}")
    print("| when | verifier | RSS MiB | KV reserved MiB | C heap MiB | of which free |")
    print("|---|---|---|---|---|---|")
    for label, name, rss, kv, heap, free in rows:
        print(f"| {label} | {name} | {rss:.0f} | {kv:.1f} | {heap:.0f} | {free:.0f} |")
    for name in sorted({r[1] for r in rows}):
        after = {r[0]: r[2] for r in rows if r[1] == name}
        base = after.get("after wave 2")
        if base:
            worst = max(abs(after[f"after wave {w}"] / base - 1) for w in range(2, args.waves + 1))
            print(f"{name}: RSS after waves 2..{args.waves} within {worst * 100:.1f}% of wave 2")
    return 0


def _exit_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C: the ``finally`` blocks stop every process it started."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(args) -> int:
    _exit_on_sigterm()
    if args.waves:
        return waves(args)
    with tempfile.TemporaryDirectory(prefix="racer-soak-") as tmp:
        soak = Soak(args, Path(tmp))
        try:
            t0 = time.monotonic()
            tally = soak.run()
            seconds = time.monotonic() - t0
        finally:
            soak.close()
        print(f"soak: {args.minutes:g} min of load, {args.clients} clients, model {args.model}, dtype {args.dtype}")
        for t, what in soak.faults:
            print(f"  fault at {t:.0f} s: {what}")
        print()
        print("| turns answered | identical | changed | failed | hung up |")
        print("|---|---|---|---|---|")
        failed = ", ".join(f"{n} {s}" for s, n in sorted(tally.failed.items())) or "0"
        print(f"| {tally.answered} | {tally.identical} | {len(tally.changed)} | {failed} | {tally.hung_up} |")
        print()
        print("\n".join(memory_table(soak.memory, args.minutes * 60)))
        for what, expected, got in tally.changed[:5]:
            print(f"changed ({what}): expected {expected!r}, got {got!r}")
        ok = not tally.changed and not tally.failed and len(soak.faults) == 3
        print(f"\n{'PASS' if ok else 'FAIL'}: {len(soak.faults)}/3 faults, {seconds:.0f} s")
        return 0 if ok else 1
