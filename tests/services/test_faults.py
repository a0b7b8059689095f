"""Faults with real processes and a real Redis: every service runs as ``racer serve ...``.

Killed (SIGKILL), frozen (SIGSTOP), terminated (SIGTERM) and restarted drafters, verifiers, gateways
and Redis, while sessions stream. Outputs are compared token for token with plain greedy decoding.

A turn is held at a known point, never raced: the gateways reach the verifiers through proxies in
this process (``tests/support/holds.py``), which hold a session's requests after its open until the
test releases them. The turn has streamed its first chunk and can go no further, however fast the
machine, so the fault lands mid-stream for sure; a metric or the services' Stats proves it did. A
test about the gateway itself dying freezes it (SIGSTOP) and reads in the backends' Stats that the
turn had rounds to come.

Timeouts here are hang guards unless a test is about one: a backend the test freezes is not left
(RACER_BACKEND_TIMEOUT), nor a silent peer dropped (keepalive), nor a lease lost, for as long as a
slow machine may take; the test of the backend timeout has a gateway of its own with a short one.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import grpc
import pytest

from drafter.snapshot import snapshot_length
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.holds import BackendProxy, Hold, holding
from tests.support.procs import Proc, RedisProc, TurnSpan, drafter_procs, drain_mid_turn, reap, verifier_procs
from tests.support.stack import prompt, wait_until

N = 240  # a turn's tokens: a fault lands after its first chunk, with rounds to come (the turn is held there)
# The backends' (and proxies') keepalive: a frozen gateway is dropped after twice this. Long enough that
# no ping goes unanswered for it on a loaded machine, nor expires across the short freezes of backends.
KEEPALIVE = 5.0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_llama):
    """The tiny Llama as a model directory (weights and config, no tokenizer) for verifier processes."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.save_pretrained(path)
    return path


class Cluster:
    """Redis, two verifiers, two drafters and a gateway over all of them, as processes; the gateways
    reach each verifier through a proxy of this process (``held``)."""

    def __init__(self, tmp, model_dir):
        self.tmp = tmp
        self.redis = RedisProc(tmp / "redis").start()
        # A SIGTERMed backend drains until its streams have moved (each at its next message), however
        # long that takes on a slow machine: the drain's bound is a hang guard.
        common = {"RACER_DRAIN_SECONDS": "60", "RACER_KEEPALIVE_SECONDS": f"{KEEPALIVE:g}"}
        self.verifiers = verifier_procs(2, model_dir, tmp, common)
        self.drafters = drafter_procs(2, self.redis.url, tmp, dict(common, RACER_SNAPSHOT_EVERY="2"))
        self.proxies = {v.name: BackendProxy(v.target, KEEPALIVE) for v in self.verifiers}
        self.gateway = self.make_gateway("gateway", self.verifiers)
        self.extra: list[Proc] = []

    def make_gateway(self, name: str, verifiers: list[Proc], direct: bool = False, **env: str) -> Proc:
        """A gateway over ``verifiers`` (through their proxies; ``direct``: not) and both drafters;
        ``env``: its settings beyond these."""
        settings = {
            "RACER_MODEL": "none",
            "RACER_SESSION_URL": self.redis.url,
            # on SIGTERM the running turns get 1 s, then 1 s to end when stopped (min(1 s, half of it))
            "RACER_DRAIN_SECONDS": "2",
            "RACER_DRAFTERS": ",".join(d.target for d in self.drafters),
            "RACER_VERIFIERS": ",".join(v.target if direct else self.proxies[v.name].target for v in verifiers),
            # Hang guards: a backend a test freezes is waited for, a restarted verifier may take
            # minutes to serve on a loaded machine, Redis may be down for a while, and a lease is not
            # lost while Redis is down (each test about one of these sets its own)...
            "RACER_BACKEND_TIMEOUT": "120",
            "RACER_RECONNECT_SECONDS": "300",
            "RACER_STORE_RETRY_SECONDS": "60",
            "RACER_LEASE_SECONDS": "120",
            # ...and no frozen drafter is dropped by the gateway's keepalive (nothing here waits for it)
            "RACER_KEEPALIVE_SECONDS": "60",
        }
        settings.update(env)
        return Proc("gateway", settings, self.tmp, name)

    def held(self, sid: str | None = None):
        """``holding`` on every verifier's proxy: the turn of ``sid`` (None: the next new session) is
        held after its verifier's open, until released."""
        return holding(self.proxies.values(), sid)

    @property
    def procs(self) -> list[Proc]:
        return [*self.verifiers, *self.drafters, self.gateway, *self.extra]

    def start(self) -> "Cluster":
        for px in self.proxies.values():
            px.start()
        for p in self.procs:
            p.start()
        for p in self.procs:
            p.wait_healthy()
        return self

    def holder(self, sid: str, procs: list[Proc]) -> Proc:
        """The live backend among ``procs`` holding the most of ``sid`` (the gateway tells clients
        no backend addresses; an operator asks the backends, with the internal token)."""

        def held(p: Proc) -> int:
            for s in p.sessions():
                if s.session_id == sid:
                    return s.tokens if p.kind == "drafter" else s.cache_tokens
            return -1

        best = max((p for p in procs if p.alive()), key=held)
        assert held(best) >= 0, f"no live backend holds {sid}"
        return best

    def session_state(self, sid: str):
        """(drafter sessions, verifier sessions) of ``sid`` on every live drafter and verifier."""
        d = [s for p in self.drafters if p.alive() for s in p.sessions() if s.session_id == sid]
        v = [s for p in self.verifiers if p.alive() for s in p.sessions() if s.session_id == sid]
        return d, v

    def released(self, sid: str) -> bool:
        d, v = self.session_state(sid)
        return not any(s.streaming for s in d + v)

    def close(self):
        reap([*self.procs, self.redis])
        for px in self.proxies.values():
            px.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("cluster"), tiny_model_dir)
    try:
        c.start()
        yield c
    finally:
        c.close()


@pytest.fixture
def healthy(cluster):
    """Every process of the cluster is up again after a test that killed some."""
    yield cluster
    if cluster.redis.proc.poll() is not None:
        cluster.redis.start()
    for p in cluster.procs:
        if p.alive():
            p.signal(signal.SIGCONT)  # a test that failed while it held a process
        else:
            p.start()
    for p in cluster.procs:
        p.wait_healthy()


def first_turn(target: str, seed: int, n: int = 20, budget: int = 8):
    p = prompt(seed)
    with Client(target, timeout=60) as c:
        ids, _, last = c.complete(p, max_new_tokens=n, budget=budget)
    return p, ids, last.session_id


def stream_turn(
    target: str, sid: str, p2: list[int], n: int, on_first, budget: int = 4, timeout: float = 90, mode: str = ""
):
    """Streams one turn; ``on_first()`` runs after the first chunk arrived. Returns (ids, last).
    ``mode`` "off": the turn's rounds are one verifier run (``VerifyTree.run``)."""
    got: list[int] = []
    last = None
    with Client(target, timeout=timeout) as c:
        for i, r in enumerate(c.generate(p2, session_id=sid, max_new_tokens=n, budget=budget, mode=mode)):
            got.extend(r.token_ids)
            last = r
            if i == 0:
                on_first()
    return got, last


def fault_held(hold: Hold, fault):
    """An ``on_first`` for ``stream_turn``: once the turn waits in the proxy (its open answered, its
    first chunk out, its next request to the verifier held), ``fault()``; then the turn goes on."""

    def on_first():
        assert hold.waiting.wait(60), "the turn never sent its verifier a request after the open"
        fault()
        hold.release()

    return on_first


def test_drafter_sigkill_mid_stream_fails_over_and_restores_from_redis(healthy, tiny_llama):
    cl = healthy
    p1, ids1, sid = first_turn(cl.gateway.target, 1)
    owner = cl.holder(sid, cl.drafters)
    other = next(d for d in cl.drafters if d is not owner)
    restored = other.metric("racer_drafter_restores_total", source="snapshot")
    failovers = cl.gateway.metric("racer_failovers_total", kind="drafter")
    p2 = prompt(101, n=4)

    def fault():  # the turn waits on its verifier while its drafter dies
        owner.proc.kill()
        owner.proc.wait(10)

    with cl.held(sid) as hold:
        got, last = stream_turn(cl.gateway.target, sid, p2, N, fault_held(hold, fault))
    assert got == hf_greedy(tiny_llama, p1 + ids1 + p2, N), "output differs from plain greedy"
    assert last.usage.completion_tokens == N == len(got), "a token was lost or duplicated"
    assert cl.gateway.metric("racer_failovers_total", kind="drafter") == failovers + 1
    assert other.metric("racer_drafter_restores_total", source="snapshot") == restored + 1, "restored from Redis"
    assert sid in {s.session_id for s in other.sessions()}
    assert Client(cl.gateway.target).get_session(sid).turns == 2


@pytest.mark.parametrize("mode", ["racer", "off"])  # off: the verifier dies inside a run
def test_verifier_sigkill_mid_stream_moves_the_session_to_the_other_verifier(healthy, tiny_llama, mode):
    cl = healthy
    p1, ids1, sid = first_turn(cl.gateway.target, 2 if mode == "racer" else 12)
    victim = cl.holder(sid, cl.verifiers)
    other = next(v for v in cl.verifiers if v is not victim)
    failovers = cl.gateway.metric("racer_failovers_total", kind="verifier")
    p2 = prompt(102 if mode == "racer" else 112, n=4)
    runs = other.metric("racer_verifier_run_rounds_total")
    with cl.held(sid) as hold:  # the victim has answered the open, and nothing since (not even a run)
        got, last = stream_turn(cl.gateway.target, sid, p2, N, fault_held(hold, victim.kill), mode=mode)
    if mode == "off":  # the rest of the turn went to the other verifier as a run
        assert other.metric("racer_verifier_run_rounds_total") > runs
    assert got == hf_greedy(tiny_llama, p1 + ids1 + p2, N)
    assert last.usage.completion_tokens == N == len(got)
    assert cl.gateway.metric("racer_failovers_total", kind="verifier") == failovers + 1
    assert Client(cl.gateway.target).get_session(sid).turns == 2 and cl.holder(sid, cl.verifiers) is other
    held = {s.session_id: s.cache_tokens for s in other.sessions()}
    assert held[sid] >= len(p1 + ids1 + p2 + got) - 1, "the other verifier re-prefilled the history"


BACKEND_TIMEOUT = 5  # s: the gateway of the backend timeout's test leaves a backend silent this long


@pytest.mark.parametrize("mode", ["racer", "off"])  # off: the verifier freezes inside a run
def test_a_frozen_verifier_is_left_after_the_backend_timeout(healthy, tiny_llama, mode):
    cl = healthy
    gw = cl.make_gateway(f"gateway-timeout-{mode}", cl.verifiers, RACER_BACKEND_TIMEOUT=f"{BACKEND_TIMEOUT}")
    try:
        gw.start().wait_healthy()
        p1, ids1, sid = first_turn(gw.target, 5 if mode == "racer" else 15)
        victim = cl.holder(sid, cl.verifiers)
        other = next(v for v in cl.verifiers if v is not victim)
        p2 = prompt(107 if mode == "racer" else 117, n=4)

        def freeze():  # the victim has answered the open, and gets the turn's next request frozen
            victim.signal(signal.SIGSTOP)
            wait_until(victim.stopped, what="the verifier stopped")

        try:
            with cl.held(sid) as hold:
                got, last = stream_turn(gw.target, sid, p2, N, fault_held(hold, freeze), mode=mode)
            assert victim.stopped(), "the verifier was still frozen when the turn ended"
        finally:
            victim.signal(signal.SIGCONT)
        # left by RACER_BACKEND_TIMEOUT, the gateway's reason for the failover, not by a longer wait
        assert gw.metric("racer_failovers_total", kind="verifier") == 1
        assert f"no answer in {BACKEND_TIMEOUT} s" in gw.log_text()
        assert got == hf_greedy(tiny_llama, p1 + ids1 + p2, N) and last.usage.completion_tokens == N
        assert sid in {s.session_id for s in other.sessions()}, "the session moved to the other verifier"
        wait_until(
            lambda: not any(s.streaming for s in victim.sessions()),
            timeout=60,
            what="the thawed verifier's stream ended",
        )
    finally:
        reap([gw])


def test_the_only_verifier_killed_and_restarted_mid_turn(healthy, tiny_llama):
    cl = healthy
    v = cl.verifiers[0]
    gw = cl.make_gateway("gateway-one-verifier", [v])
    cl.extra.append(gw)
    gw.start().wait_healthy()
    p1, ids1, sid = first_turn(gw.target, 3)
    p2 = prompt(103, n=4)
    restarted = threading.Event()

    def fault():
        v.kill()  # the turn now waits for a verifier (RACER_RECONNECT_SECONDS, a hang guard here)
        threading.Thread(target=lambda: (v.start(), restarted.set()), daemon=True).start()

    with cl.held(sid) as hold:
        got, last = stream_turn(gw.target, sid, p2, N, fault_held(hold, fault))
    assert restarted.is_set()
    assert got == hf_greedy(tiny_llama, p1 + ids1 + p2, N)
    assert last.usage.completion_tokens == N
    # the new process had nothing cached: it prefilled the whole history
    assert v.metric("racer_verifier_reused_tokens_total") == 0
    assert v.metric("racer_prefill_latency_seconds_count") >= 1
    with Client(gw.target, timeout=60) as c:
        p3 = prompt(104, n=4)
        ids3, _, _ = c.complete(p3, session_id=sid, max_new_tokens=10)
    assert ids3 == hf_greedy(tiny_llama, p1 + ids1 + p2 + got + p3, 10)
    assert v.metric("racer_verifier_reused_tokens_total") > 0, "the next turn reused the cache"


def test_redis_stopped_mid_session_and_restarted(healthy, tiny_llama):
    cl = healthy
    p1, ids1, sid = first_turn(cl.gateway.target, 4)
    owner = cl.holder(sid, cl.drafters)
    r = cl.redis.client()
    key = f"racer:drafter:local:{sid}"
    wait_until(lambda: r.exists(key), what="first snapshot")
    failures = owner.metric("racer_snapshot_failures_total", op="save")
    store_failures = cl.gateway.metric("racer_store_failures_total", op="set")
    p2 = prompt(105, n=4)
    back, ended = threading.Event(), threading.Event()

    def restart():
        # Redis comes back once the gateway has failed to save the turn's record, not after a fixed
        # time: the rest of the turn runs without Redis however slow the machine is, and the save at
        # its end meets a stopped Redis for sure. (A restart after 1 s raced the turn: on a busy
        # machine Redis was back before the turn ended and the save went through at the first try.)
        # The gateway retries the save for RACER_STORE_RETRY_SECONDS; a turn that failed meanwhile
        # (``ended``) brings Redis back too.
        while not ended.is_set() and cl.gateway.metric("racer_store_failures_total", op="set") <= store_failures:
            time.sleep(0.05)
        cl.redis.start()
        back.set()

    restarter = threading.Thread(target=restart, daemon=True)

    def fault():  # the turn waits on its verifier while Redis stops
        cl.redis.stop()
        restarter.start()

    try:
        with cl.held(sid) as hold:
            got, last = stream_turn(cl.gateway.target, sid, p2, N, fault_held(hold, fault))
    finally:
        ended.set()  # a turn that failed: Redis comes back now, before the fixture looks
        if restarter.ident is not None:
            restarter.join(30)
    assert back.is_set()
    history = p1 + ids1 + p2
    assert got == hf_greedy(tiny_llama, history, N), "generation went on without Redis"
    assert last.usage.completion_tokens == N
    assert owner.metric("racer_snapshot_failures_total", op="save") > failures, "skipped snapshots are counted"
    assert "snapshot save failed" in owner.log_text(), "and logged"
    assert cl.gateway.metric("racer_store_failures_total", op="set") > store_failures, "the record save was retried"
    history += got
    assert Client(cl.gateway.target).get_session(sid).tokens == len(history), "the turn was saved once Redis was back"
    # snapshots resume: the next turn's end leaves a snapshot of the whole session
    p3 = prompt(106, n=4)
    with Client(cl.gateway.target, timeout=60) as c:
        # Budget 2: at least 4 rounds for 12 tokens, so steps commit some of them whatever the
        # machine's speed (the adaptive budget can make it one round, which no step follows).
        ids3, _, _ = c.complete(p3, session_id=sid, max_new_tokens=12, budget=2)
    assert ids3 == hf_greedy(tiny_llama, history + p3, 12)
    # (the drafter learns a round's tokens with the next step: the last round's come with the next open)
    fresh = len(history + p3) + 1
    wait_until(lambda: r.exists(key) and snapshot_length(r.get(key)) >= fresh, timeout=60, what="a fresh snapshot")


# The client's deadline in the deadline case: the turn is held after its first chunk until it passes.
# Only the first chunk must come before it (tens of ms); on a machine slower than that, the deadline
# cuts the turn in its open instead, which frees the same state.
DEADLINE = 5.0


def test_client_cancel_and_deadline_free_the_round_state_everywhere(healthy, tiny_llama):
    cl = healthy
    # cancel mid-stream: the turn is held after its first chunk, so the cancel ends a running turn
    with cl.held() as hold, Client(cl.gateway.target) as c:
        call = c.generate(prompt(7), max_new_tokens=900, budget=2)
        sid = next(call).session_id
        assert hold.waiting.wait(60) and hold.session_id == sid
        assert not cl.released(sid), "the turn was not running when it was cancelled"
        call.cancel()
        wait_until(lambda: cl.released(sid), timeout=60, what="drafter and verifier streams freed after a cancel")
    with Client(cl.gateway.target) as c, pytest.raises(grpc.RpcError) as e:
        c.get_session(sid)  # a cancelled first turn leaves no session behind
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # deadline mid-turn of an existing session: the turn is not saved, the session goes on
    p1, ids1, sid = first_turn(cl.gateway.target, 8)
    with cl.held(sid):  # the turn cannot finish before its deadline, however fast the machine
        with Client(cl.gateway.target, timeout=DEADLINE) as c, pytest.raises(grpc.RpcError) as e:
            c.complete(prompt(108, n=4), session_id=sid, max_new_tokens=900, budget=1, mode="off")
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: cl.released(sid), timeout=60, what="drafter and verifier streams freed after a deadline")
        wait_until(lambda: cl.gateway.metric("racer_active_streams") == 0, timeout=60, what="gateway streams ended")
    p3 = prompt(109, n=4)
    verifier = cl.holder(sid, cl.verifiers)
    reused = verifier.metric("racer_verifier_reused_tokens_total")
    with Client(cl.gateway.target, timeout=60) as c:
        ids3, _, last = c.complete(p3, session_id=sid, max_new_tokens=10)
    assert ids3 == hf_greedy(tiny_llama, p1 + ids1 + p3, 10)
    assert Client(cl.gateway.target).get_session(sid).turns == 2
    # the cut turn did not cost the KV cache: the session's earlier tokens were reused
    assert verifier.metric("racer_verifier_reused_tokens_total") - reused >= len(p1 + ids1) - 1


def frozen_mid_turn(cl: Cluster, gw: Proc, seed: int, n: int = 900):
    """A new session's turn of ``n`` tokens on ``gw``, and ``gw`` frozen (SIGSTOP) while the turn has
    rounds to come: (client, call, session id). After the first chunk the gateway is frozen, then its
    verifier's Stats must show the turn's stream with fewer tokens than the turn's end (frozen, the
    gateway can end nothing); a turn that got there first is let go and another one tried."""
    for attempt in range(5):
        p = prompt(seed + attempt)
        c = Client(gw.target)
        call = c.generate(p, max_new_tokens=n, budget=2)
        sid = next(call).session_id
        gw.signal(signal.SIGSTOP)
        wait_until(gw.stopped, what="the gateway stopped")
        held = [s for v in cl.verifiers for s in v.sessions() if s.session_id == sid]
        if held and held[0].streaming and held[0].cache_tokens < len(p) + n - 1:
            return c, call, sid
        gw.signal(signal.SIGCONT)  # the turn had (nearly) ended: it finishes, and another one is tried
        for _ in call:
            pass
        c.close()
    raise AssertionError("every turn ended before its gateway was frozen")


def test_a_killed_or_frozen_gateway_frees_the_round_state(healthy):
    cl = healthy
    # The gateway reaches the verifiers directly: the backends themselves must see it gone.
    gw = cl.make_gateway("gateway-direct", cl.verifiers, direct=True)
    try:
        for i, fault in enumerate(("SIGKILL", "SIGSTOP")):
            gw.start().wait_healthy()
            c, call, sid = frozen_mid_turn(cl, gw, 9 + 10 * i)
            assert not cl.released(sid)
            if fault == "SIGKILL":
                gw.kill()
            # else it stays frozen: the backends' keepalive (KEEPALIVE, twice over) finds the silent peer
            wait_until(lambda: cl.released(sid), timeout=60, what=f"streams freed after the gateway got {fault}")
            call.cancel()
            c.close()
            gw.kill()
    finally:
        reap([gw])


def _load(
    target: str, jobs: list[tuple[str, list[int], int]], results: dict, budget: int = 4, started: set | None = None
):
    """One thread per (session, prompt, n): results[i] = ("ok", ids) or (status code, details);
    ``started`` (a set) gets i once turn i's first chunk arrived (its streams are open)."""

    def one(i, sid, p, n):
        try:
            ids: list[int] = []
            with Client(target, timeout=90) as c:
                for r in c.generate(p, session_id=sid, max_new_tokens=n, budget=budget):
                    ids.extend(r.token_ids)
                    if ids and started is not None:
                        started.add(i)
            results[i] = ("ok", ids)
        except grpc.RpcError as e:
            results[i] = (e.code(), e.details())

    threads = [threading.Thread(target=one, args=(i, *job), daemon=True) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("kind", ["drafter", "verifier"])
def test_sigterm_on_a_backend_under_load_loses_no_stream(healthy, tiny_llama, kind):
    cl = healthy
    starts = [first_turn(cl.gateway.target, 300 + i, n=6) for i in range(4)]
    jobs = [(sid, prompt(400 + i, n=4), N) for i, (_, _, sid) in enumerate(starts)]
    spans = [TurnSpan(len(p1 + ids1 + p2), len(p1 + ids1 + p2) + n) for (p1, ids1, _), (_, p2, n) in zip(starts, jobs)]
    moved = cl.gateway.metric("racer_sessions_moved_total", kind=kind, reason="drain")
    results: dict = {}
    started: set[int] = set()
    budget = 4
    with contextlib.ExitStack() as holding_all:
        # Every turn is held after its first chunk: all four stream, with all their rounds to come,
        # however fast the machine, until the victim drains.
        holds = [holding_all.enter_context(cl.held(sid)) for sid, _, _ in jobs]
        threads = _load(cl.gateway.target, jobs, results, budget, started)
        for h in holds:
            assert h.waiting.wait(60), "a turn never sent its verifier a request after the open"

        def running() -> dict[str, TurnSpan]:
            return {jobs[i][0]: spans[i] for i in list(started) if i not in results}

        # The victim is a backend one of these turns streams through with rounds to come when SIGTERM
        # comes (the backends of the other kind frozen meanwhile). Not a fixed one: drafters are chosen
        # by rendezvous hashing of the (random) session ids, so all four sessions miss drafters[0] once
        # in 16 runs. (A fixed budget: no adaptive rest, so a round emits at most ``budget`` tokens.)
        pool, frozen = (cl.drafters, cl.verifiers) if kind == "drafter" else (cl.verifiers, cl.drafters)
        victim = drain_mid_turn(pool, frozen, running, budget, timeout=60)
    assert victim.wait_exit(60) == 0, f"{victim.name} did not exit cleanly after SIGTERM"
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    for i, (p1, ids1, _sid) in enumerate(starts):
        assert results[i] == ("ok", hf_greedy(tiny_llama, p1 + ids1 + jobs[i][1], N)), f"session {i}"
    # the turn in mid-stream on the victim moved at its next message (a drain, not a failover)
    assert cl.gateway.metric("racer_sessions_moved_total", kind=kind, reason="drain") > moved


# The pace of the gateway drain's slow turns: a round's answer at most every PACE seconds, so their
# 900 rounds last 9 s at least on any machine, far past the 1 s the drain lets turns run (a faster
# machine cannot shorten a pace); stopped, each ends at its next round, within PACE.
PACE = 0.01


def test_sigterm_on_the_gateway_under_load_ends_every_stream_clearly(healthy, tiny_llama):
    cl = healthy
    starts = [first_turn(cl.gateway.target, 500 + i, n=6) for i in range(4)]
    jobs = [(sid, prompt(600 + i, n=4), 900) for i, (_, _, sid) in enumerate(starts)]
    results: dict = {}
    slow = (0, 1)  # still running when the drain stops its turns, for sure; the two others may finish first
    with contextlib.ExitStack() as holding_all:
        holds = [holding_all.enter_context(cl.held(sid)) for sid, _, _ in jobs]
        threads = _load(cl.gateway.target, jobs, results, budget=1)
        for h in holds:  # all four stream (their first chunk is out), held until the SIGTERM
            assert h.waiting.wait(60), "a turn never sent its verifier a request after the open"
        logged = len(cl.gateway.log_text())
        cl.gateway.signal(signal.SIGTERM)
        for i, h in enumerate(holds):
            h.release(pace=PACE if i in slow else 0.0)
        assert cl.gateway.wait_exit(60) == 0
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    # the drain ended every turn itself within RACER_DRAIN_SECONDS: none was left to the shutdown
    assert "turns still running at shutdown" not in cl.gateway.log_text()[logged:]
    for i, (code, details) in results.items():
        if code == "ok":
            assert i not in slow, f"turn {i} outran its pace"
            assert details == hf_greedy(tiny_llama, starts[i][0] + starts[i][1] + jobs[i][1], 900)
        else:
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details, (code, details)
    assert sorted(results) == [0, 1, 2, 3]
    for _, _, sid in starts:
        wait_until(lambda: cl.released(sid), timeout=60, what="drafter and verifier streams freed")
    cl.gateway.start().wait_healthy()
    with Client(cl.gateway.target) as c:
        for i, (code, _) in results.items():
            assert c.get_session(starts[i][2]).turns == (2 if code == "ok" else 1), "an ended turn was not saved"


def test_a_gateway_killed_mid_turn_its_lease_expires_and_another_gateway_goes_on(healthy, tiny_llama):
    cl = healthy
    # A's turns take a lease of 1 s: once A is dead, B waits that long for the session. (B keeps the
    # long lease: a renewal of B's own turn that came late on a busy machine would lose it.)
    gws = [cl.make_gateway("lease-gateway0", cl.verifiers, RACER_LEASE_SECONDS="1")]
    gws.append(cl.make_gateway("lease-gateway1", cl.verifiers))
    for g in gws:
        g.start()
    try:
        for g in gws:
            g.wait_healthy()
        a, b = gws
        p1, ids1, sid = first_turn(a.target, 12)
        # gateway A is killed after its turn's first chunk, the turn held: it is lost, its lease stays behind
        with cl.held(sid) as hold, pytest.raises(grpc.RpcError) as e:
            stream_turn(a.target, sid, prompt(112, n=4), 900, fault_held(hold, a.kill), budget=1)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_until(lambda: cl.released(sid), timeout=60, what="the backends saw A's streams end")
        # on gateway B the session is ABORTED ("a turn is already running") until that lease expires
        p3, deadline = prompt(113, n=4), time.monotonic() + 60
        while True:
            try:
                with Client(b.target, timeout=60) as c:
                    ids3 = c.complete(p3, session_id=sid, max_new_tokens=10)[0]
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.ABORTED and "already running" in err.details()
                assert time.monotonic() < deadline, "the dead gateway's lease never expired"
                wait_until(lambda: not cl.redis.client().exists(f"racer:lease:local:{sid}"), what="lease expired")
        assert ids3 == hf_greedy(tiny_llama, p1 + ids1 + p3, 10)
        info = Client(b.target).get_session(sid)  # A's lost turn is not in it, B's is, once
        assert info.turns == 2 and info.tokens == len(p1 + ids1 + p3 + ids3)
        assert Client(b.target).close_session(sid).closed
    finally:
        reap(gws)
