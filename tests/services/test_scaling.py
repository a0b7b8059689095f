"""Scaling under load, with real processes and a real Redis: verifiers 2 -> 3 -> 1, drafters 2 -> 1.

Concurrent clients run multi-turn sessions (a new session after every ``TURNS`` turns) while a third
verifier starts (it must receive new sessions once ready), the first two get SIGTERM (their
sessions move to the others at their next round, re-prefilled from the history) and a drafter gets
SIGTERM (its sessions restore from their snapshots on the other). Every turn must complete and
equal Hugging Face greedy decoding (float32) of the session's whole history; no stream may count as
lost (drains are moves, not failovers); the moves and re-prefilled tokens are counted by metrics.

Each event waits on what proves it (a verifier's Stats shows a stream, a process exits, a counter
moves), never on a sleep. Each drained backend gets SIGTERM while a turn streams through it with
rounds to come, held there by freezing the backends of the other kind for that moment
(``drain_mid_turn``), so every drain moves a session. Sized for CI (tiny model, 3 clients, 3 turns
of 48 tokens); the ``SCALE_CLIENTS``, ``SCALE_TURNS``, ``SCALE_TOKENS`` and ``SCALE_STEADY_TURNS``
(turns before and after the events) environment variables make it bigger, and ``pytest -s`` prints
its table:
    SCALE_CLIENTS=8 SCALE_STEADY_TURNS=64 PYTHONPATH=. python -m pytest tests/services/test_scaling.py -s
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.procs import Proc, RedisProc, TurnSpan, drafter_procs, drain_mid_turn, reap, verifier_procs
from tests.support.stack import prompt, wait_until

CLIENTS = int(os.environ.get("SCALE_CLIENTS", "3"))
TURNS = int(os.environ.get("SCALE_TURNS", "3"))
TOKENS = int(os.environ.get("SCALE_TOKENS", "48"))
STEADY = int(os.environ.get("SCALE_STEADY_TURNS", str(CLIENTS)))  # turns before and after the events
BUDGET = 4


@dataclass
class Turn:
    history: list[int]  # the session's tokens before this turn's input
    input: list[int]
    start: float
    first: float = 0.0
    end: float = 0.0
    ids: list[int] = field(default_factory=list)
    status: str = "OK"
    session_id: str = ""  # known from the first response of a session's first turn


class Load:
    """``CLIENTS`` threads, each running sessions of ``TURNS`` turns one after another until stopped."""

    def __init__(self, target: str):
        self.target = target
        self.turns: list[Turn] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _client(self, i: int) -> None:
        seed = 1000 * i
        with Client(self.target, timeout=120) as c:
            while not self.stop.is_set():
                history: list[int] = []
                sid = ""
                for t in range(TURNS):
                    seed += 1
                    turn = Turn(list(history), prompt(seed, n=12 if t == 0 else 4), time.monotonic(), session_id=sid)
                    self.turns.append(turn)
                    try:
                        for r in c.generate(
                            turn.input, session_id=sid, max_new_tokens=TOKENS, budget=BUDGET, stop_ids=()
                        ):
                            sid = turn.session_id = r.session_id or sid
                            if not turn.ids and r.token_ids:
                                turn.first = time.monotonic()
                            turn.ids.extend(r.token_ids)
                    except grpc.RpcError as e:
                        turn.status = f"{e.code().name}: {e.details()}"
                        return
                    turn.end = time.monotonic()
                    history += turn.input + turn.ids
                c.close_session(sid)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)

    def done(self) -> int:
        return sum(1 for t in self.turns if t.end)

    def running(self) -> dict[str, TurnSpan]:
        """The turns whose first chunk arrived and that have not ended, by session id."""
        spans = {}
        for t in list(self.turns):
            if t.ids and not t.end and t.status == "OK":
                base = len(t.history) + len(t.input)
                spans[t.session_id] = TurnSpan(base, base + TOKENS)
        return spans


def _pcts(values: list[float]) -> str:
    if not values:
        return "-"
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return f"{statistics.median(values) * 1e3:.0f} / {q[98] * 1e3:.0f}"


def report(turns: list[Turn], window: tuple[float, float], moved: dict, reprefilled: float) -> str:
    """The figures: turns by phase (before, overlapping and after the scaling events), TTFT and
    time per output token p50/p99."""
    rows = []
    for phase, sel in (
        ("steady before (2 verifiers, 2 drafters)", [t for t in turns if t.end and t.end < window[0]]),
        ("during the events", [t for t in turns if t.end and not (t.end < window[0] or t.start > window[1])]),
        ("steady after (1 verifier, 1 drafter)", [t for t in turns if t.end and t.start > window[1]]),
    ):
        ttft = [t.first - t.start for t in sel]
        tpot = [(t.end - t.first) / (len(t.ids) - 1) for t in sel if len(t.ids) > 1]
        rows.append(f"| {phase} | {len(sel)} | {_pcts(ttft)} | {_pcts(tpot)} |")
    return "\n".join(
        [
            "| phase | turns | TTFT p50 / p99 (ms) | time per output token p50 / p99 (ms) |",
            "|---|---|---|---|",
            *rows,
            f"sessions moved: {moved}; re-prefilled tokens: {reprefilled:.0f}",
        ]
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llama):
    path = tmp_path_factory.mktemp("tiny-llama-scaling")
    tiny_llama.save_pretrained(path)
    return path


def test_verifiers_two_three_one_and_drafters_two_one_under_load(tmp_path, model_dir, tiny_llama):
    redis = RedisProc(tmp_path / "redis").start()
    # Bounds that are hang guards here, never the test's point: a drained backend waits for its
    # streams to move (each at its next message) however long a slow machine takes, and no keepalive
    # ping goes unanswered long enough to drop a peer, not even one sent as ``drain_mid_turn`` froze a
    # backend (a short keepalive turns such a freeze on a slow machine into a lost stream: a failover).
    common = {"RACER_DRAIN_SECONDS": "120", "RACER_KEEPALIVE_SECONDS": "120"}
    verifiers = verifier_procs(3, model_dir, tmp_path, common)
    drafters = drafter_procs(2, redis.url, tmp_path, dict(common, RACER_SNAPSHOT_EVERY="4"))
    gateway = Proc(
        "gateway",
        {
            "RACER_MODEL": "none",
            "RACER_SESSION_URL": redis.url,
            "RACER_DRAFTERS": ",".join(d.target for d in drafters),
            "RACER_VERIFIERS": ",".join(v.target for v in verifiers),  # the third starts later
            "RACER_RECONNECT_SECONDS": "60",
            "RACER_KEEPALIVE_SECONDS": "120",
            "RACER_BACKEND_TIMEOUT": "120",
        },
        tmp_path,
    )
    procs = [*verifiers, *drafters, gateway, redis]
    try:
        for p in [*verifiers[:2], *drafters, gateway]:
            p.start()
        for p in [*verifiers[:2], *drafters, gateway]:
            p.wait_healthy(120)

        def streams(p: Proc) -> bool:
            return any(s.streaming for s in p.sessions())

        with Load(gateway.target) as load:
            wait_until(lambda: load.done() >= STEADY, timeout=300, what="steady-state turns")
            t0 = time.monotonic()
            # 2 -> 3: the new verifier takes new sessions once it is ready.
            verifiers[2].start().wait_healthy(120)
            wait_until(lambda: streams(verifiers[2]), timeout=180, what="a session on the new verifier")
            # 3 -> 1: each verifier gets SIGTERM while a turn streams through it with rounds to come
            # (the drafters frozen meanwhile hold it there), and exits cleanly.
            for v in verifiers[:2]:
                drain_mid_turn([v], drafters, load.running, BUDGET, timeout=180)
                assert v.wait_exit(180) == 0, v.log_text()[-2000:]
            # Drafters 2 -> 1, in mid-turn too (the one verifier left frozen meanwhile).
            victim = drain_mid_turn(drafters, [verifiers[2]], load.running, BUDGET, timeout=180)
            assert victim.wait_exit(180) == 0, victim.log_text()[-2000:]
            t1 = time.monotonic()
            after = load.done()
            wait_until(lambda: load.done() >= after + STEADY, timeout=300, what="turns after the scaling")
        survivor = next(d for d in drafters if d is not victim)

        failed = [t.status for t in load.turns if t.status != "OK"]
        assert not failed, failed
        assert all(t.end for t in load.turns), "a turn did not complete"
        for t in load.turns:
            assert t.ids == hf_greedy(tiny_llama, t.history + t.input, TOKENS), "output differs from HF greedy"
        moved = {
            (kind, reason): gateway.metric("racer_sessions_moved_total", kind=kind, reason=reason)
            for kind in ("verifier", "drafter")
            for reason in ("drain", "lost", "unreachable", "gone", "full")
        }
        moved = {k: v for k, v in moved.items() if v}
        reprefilled = gateway.metric("racer_reprefilled_tokens_total")
        print(f"\n{len(load.turns)} turns, all OK and equal to HF greedy")
        print(report(load.turns, (t0, t1), moved, reprefilled))
        assert moved.get(("verifier", "drain"), 0) >= 2, moved  # a session in mid-turn moved off each
        assert moved.get(("drafter", "drain"), 0) >= 1, moved
        assert reprefilled > 0
        for kind in ("verifier", "drafter"):  # a drain is a move, never a lost stream
            assert gateway.metric("racer_failovers_total", kind=kind) == 0, kind
        # The drained drafter's sessions came back from the snapshots it wrote before it let them go.
        assert survivor.metric("racer_drafter_restores_total", source="snapshot") >= 1
    finally:
        reap(procs)
