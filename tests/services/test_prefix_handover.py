"""KV rows moved with a session off a draining verifier (a hand-over), and a joining verifier warmed.

Verifiers in this process on their own addresses, real gRPC between them and from a gateway whose
sessions live in Redis (``verifier/prefix_transfer.py``: ``serve_prefix``, ``warm``, ``handed_over``).

* A session with a few turns on verifier A; A drains (SIGTERM's drain, held open by another
  gateway's stream, so it is still up): the session's next turn goes to B, which fetches A's rows
  of the session's whole history (not only the tenant's prefix blocks) and prefills only the new
  turn's tokens; the answer is transformers' greedy one, what the conversation gives without a move.
* A stream a drain refuses marks its session as moving: the drain keeps serving until the session's
  hand-over was asked for, then exits.
* A verifier that joins is warmed by the gateway that first sees it, from the verifier holding the
  most blocks: the tenant's next session there copies its prefix without a fetch.
* A receiver whose kernels differ refuses a hand-over and a warm-up, and prefills; same output.

Races are held with the verifiers' own state (Stats, metrics), never with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue

import grpc
import pytest
from prometheus_client import REGISTRY

from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc
from racer.bench.tiny import make_tiny_llama
from racer.client import Client
from tests.services.test_placement import _stats, holder, other_gateway_streams
from tests.services.test_prefix_fetch import (
    BLOCK,
    SYSTEM,
    _holds,
    _one_plan,  # noqa: F401 - the fixture, autouse here too
    _start_verifier,
    _turn,
)
from tests.support.engine import hf_greedy
from tests.support.stack import INTERNAL_TOKEN, Stack, backend_channel, prompt, start_drafter, start_gateway, wait_until

N = 6
LONG = 2 * BLOCK + 4  # the last turn's new tokens: its rows reach past every block the prefix cache took at open


def _value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _metrics() -> dict[str, float]:
    names = {
        "sent": ("racer_verifier_prefix_handover_rows_total", {"side": "sent"}),
        "received": ("racer_verifier_prefix_handover_rows_total", {"side": "received"}),
        "sent_bytes": ("racer_verifier_prefix_handover_bytes_total", {"side": "sent"}),
        "received_bytes": ("racer_verifier_prefix_handover_bytes_total", {"side": "received"}),
        "warmed": ("racer_verifier_prefix_warmed_rows_total", {}),
        "warms": ("racer_verifier_warms_total", {"outcome": "warmed"}),
        "fetched": ("racer_verifier_prefix_fetched_blocks_total", {}),
        "reprefilled": ("racer_reprefilled_tokens_total", {}),
        "moved_drain": ("racer_sessions_moved_total", {"kind": "verifier", "reason": "drain"}),
        **{
            f"{use}_{r}": ("racer_verifier_prefix_transfer_refused_total", {"use": use, "reason": r})
            for use in ("handover", "warm")
            for r in ("scope", "fingerprint", "hash", "source", "deadline", "budget")
        },
    }
    return {k: _value(n, **ls) for k, (n, ls) in names.items()}


@contextlib.contextmanager
def _delta():
    before, out = _metrics(), {}
    yield out
    after = _metrics()
    out.update({k: after[k] - before[k] for k in after})


def _refused(d: dict, use: str) -> float:
    return sum(v for k, v in d.items() if k.startswith(f"{use}_"))


def _stack(loop_thread, model, redis_url, verifiers: int = 2, **settings) -> Stack:
    st = Stack(loop_thread)
    st.verifiers = [_start_verifier(loop_thread, model, **settings) for _ in range(verifiers)]
    st.drafters = [start_drafter(loop_thread, internal_token=INTERNAL_TOKEN)]
    st.gateway_pair = start_gateway(
        loop_thread,
        model.config.vocab_size,
        internal_token=INTERNAL_TOKEN,
        session_url=redis_url,
        drafters=st.drafter_target(0),
        verifiers=",".join(st.verifier_target(i) for i in range(verifiers)),
    )
    st.gateway_pair[1].backends.load_every = 0.0  # every placement asks the verifiers afresh
    return st


@pytest.fixture
def fresh(loop_thread, tiny_llama, redis_url):
    # A drain waits for its moving sessions' hand-overs at most this long: a hang guard here
    st = _stack(loop_thread, tiny_llama, redis_url, prefix_fetch_seconds=600.0)
    yield st
    st.stop()


def _cache_tokens(st, i: int, sid: str) -> int:
    (s,) = [s for s in st.verifier_sessions(i) if s.session_id == sid]
    return s.cache_tokens


def test_a_session_moving_off_a_draining_verifier_takes_its_rows_along(fresh, loop_thread, tiny_llama):
    st = fresh
    turns = [SYSTEM + prompt(1, 7), prompt(2, 9), prompt(3, 5)]
    history: list[int] = []
    with Client(st.gateway, timeout=120) as c:
        sid = None
        for i, p in enumerate(turns):
            n = LONG if i == len(turns) - 1 else N
            ids, _, last = c.complete(p, session_id=sid, max_new_tokens=n, budget=4)
            sid = last.session_id
            assert ids == hf_greedy(tiny_llama, history + p, n)
            history += p + ids
    home = holder(st, sid)
    other = 1 - home
    held = _cache_tokens(st, home, sid)  # the session's rows on A: its history but the last token
    assert held >= len(history) - 1
    at_open = len(history) - LONG  # what A's prefix cache took of the history at the last open
    assert held // BLOCK > at_open // BLOCK  # so the session's own rows must move, not only cached blocks

    srv, core = st.verifiers[home]
    nxt = prompt(4, 6)
    # A drains; another gateway's stream keeps it up (a drain waits for its streams): it says
    # draining in Stats, and the gateway moves the session at its next turn, naming A as the source.
    with other_gateway_streams(st.verifier_target(home), 1, "hold-"):
        stopping = asyncio.run_coroutine_threadsafe(srv.stop(120), loop_thread.loop)
        wait_until(lambda: _stats(st.verifier_target(home)).draining, what="A draining")
        with _delta() as d, Client(st.gateway, timeout=120) as c:
            ids, _, _ = c.complete(nxt, session_id=sid, max_new_tokens=N, budget=4)
    stopping.result(120)  # A exits once the stream ended: the hand-over was no longer awaited
    assert any(s.session_id == sid for s in st.verifier_sessions(other))
    assert ids == hf_greedy(tiny_llama, history + nxt, N)  # what the conversation gives without a move
    assert d["moved_drain"] == 1
    assert d["received"] == held // BLOCK * BLOCK  # every full block of the session's rows on A
    assert d["sent"] == d["received"] and d["received_bytes"] == d["sent_bytes"] > 0
    assert _refused(d, "handover") == 0
    # prefilled again: the new turn, the token A had not fed, and the rows after A's last full block
    assert d["reprefilled"] == len(history) + len(nxt) - held // BLOCK * BLOCK
    assert d["reprefilled"] < len(nxt) + 1 + BLOCK


def _open(target: str, tenant: str, sid: str, history: list[int]):
    """A stream open on ``sid`` at ``target``, as a gateway holds one: (call, its queue, the open's answer)."""
    q: queue.Queue = queue.Queue()
    q.put(vpb.VerifyRequest(open=vpb.VerifierOpen(session_id=sid, tenant=tenant, history=history, reserve_tokens=8)))
    ch = backend_channel(target)
    call = vgrpc.VerifierStub(ch).Session(iter(q.get, None), timeout=120)
    return ch, call, q, next(call)


def test_a_drain_serves_the_hand_over_of_a_stream_it_refused_before_it_exits(fresh, loop_thread, tiny_llama):
    """The drain's order: the stream is refused (the session moves), the streams are gone, and the
    drain still waits until the moving session's rows were asked for; then the server stops."""
    st = fresh
    first = SYSTEM + prompt(5, 7)
    out, _ = _turn(st.verifier_target(0), "ivan", "moving", first, None, 2 * BLOCK)
    srv, core = st.verifiers[0]
    history = first + out  # the gateway's committed tokens: A's cache holds all but the last
    ch, call, q, opened = _open(st.verifier_target(0), "ivan", "moving", history)
    try:
        stopping = asyncio.run_coroutine_threadsafe(srv.stop(120), loop_thread.loop)
        wait_until(lambda: _stats(st.verifier_target(0)).draining, what="draining")
        q.put(vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[opened.next_token], parents=[-1])))
        with pytest.raises(grpc.RpcError) as refused:  # the next message: refused, the session moves
            next(call)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
    finally:
        q.put(None)
        ch.close()
    wait_until(lambda: core.streaming() == 0, what="the stream gone")
    assert core.moving == {("ivan", "moving")} and not stopping.done()
    nxt = history + [opened.next_token] + prompt(6, 5)
    source = (st.verifier_target(0), len(nxt) // BLOCK, "moving")
    with _delta() as d:
        got, opened_b = _turn(st.verifier_target(1), "ivan", "moving", nxt, source, N)
    stopping.result(120)
    assert got == hf_greedy(tiny_llama, nxt, N)
    assert d["received"] == len(history) // BLOCK * BLOCK == opened_b.fetched_tokens  # the open fed the last one
    assert opened_b.prefix_tokens == d["received"]
    assert not core.moving


@pytest.fixture(scope="module")
def fleet(loop_thread, tiny_llama, redis_url):
    st = _stack(loop_thread, tiny_llama, redis_url, verifiers=1)
    yield st
    st.stop()


def test_a_joining_verifier_is_warmed_with_a_hot_prefix(fleet, loop_thread, tiny_llama):
    st = fleet
    first = SYSTEM + prompt(7, 7)
    with Client(st.gateway, timeout=120) as c:
        ids, _, last = c.complete(first, max_new_tokens=N, budget=4)
    assert ids == hf_greedy(tiny_llama, first, N)
    tenant = next(s.tenant for s in st.verifier_sessions(0) if s.session_id == last.session_id)
    wait_until(lambda: _holds(st.verifier_target(0), tenant, SYSTEM), what="the prefix's blocks reported")

    srv, core = _start_verifier(loop_thread, tiny_llama)  # joins: the gateway learns of it (DNS, in a cluster)
    st.verifiers.append((srv, core))
    gw = st.gateway_pair[1]
    with _delta() as d:
        before = _metrics()["warms"]
        gw.backends.verifiers.endpoints.append(srv.address)
        loop_thread.run(gw.backends.refresh_loads(gw.backends.verifiers.live()))  # a placement's poll
        wait_until(lambda: _metrics()["warms"] > before, timeout=120, what="the gateway's warm-up answered")
    assert _holds(srv.address, tenant, SYSTEM)
    assert d["warms"] == 1 and d["warmed"] >= len(SYSTEM) and _refused(d, "warm") == 0
    assert core.kv_memory.held.get(("", "prefix cache"), 0) <= core.prefix_warm_share * core.kv_memory.total

    later = SYSTEM + prompt(8, 7)
    with _delta() as d:
        out, opened = _turn(srv.address, tenant, "warm-b", later, None, N)  # no holder named: none to fetch
    assert out == hf_greedy(tiny_llama, later, N)
    assert opened.prefix_tokens == len(SYSTEM) and opened.fetched_tokens == 0 and d["fetched"] == 0
    # warmed once: a second gateway's request (or a restart of this one's poll) takes nothing more
    assert loop_thread.run(core.warm(st.verifier_target(0)))[2] == "warm"


def test_a_receiver_with_other_kernels_refuses_a_hand_over_and_a_warm_up(fleet, loop_thread, tiny_llama):
    st = fleet
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RACER_KERNELS", "wxt")
        srv, core = _start_verifier(loop_thread, make_tiny_llama())
    try:
        assert _stats(srv.address).setup.prefix_fingerprint != _stats(st.verifier_target(0)).setup.prefix_fingerprint
        first = SYSTEM + prompt(9, 7)
        out, _ = _turn(st.verifier_target(0), "judy", "other-kernels", first, None, BLOCK)
        nxt = first + out + prompt(10, 5)
        source = (st.verifier_target(0), len(nxt) // BLOCK, "other-kernels")
        with _delta() as d:
            got, opened = _turn(srv.address, "judy", "other-kernels", nxt, source, N)
            warmed = loop_thread.run(core.warm(st.verifier_target(0)))
        assert got == hf_greedy(tiny_llama, nxt, N)
        assert opened.prefix_tokens == 0 and opened.fetched_tokens == 0
        assert d["handover_fingerprint"] == 1 and d["received"] == 0
        assert warmed == (0, 0, "fingerprint") and d["warm_fingerprint"] == 1 and d["warmed"] == 0
        assert core.warmed == 0 and not core.warming  # a later warm-up may still be tried
    finally:
        loop_thread.run(srv.stop(0))
        core.close()


def test_a_warm_request_without_a_source_is_refused(fleet):
    with backend_channel(fleet.verifier_target(0)) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            vgrpc.VerifierStub(ch).Warm(vpb.VerifierWarmRequest(), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "source" in refused.value.details()
