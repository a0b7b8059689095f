"""Placement of sessions on verifiers, by what the verifiers report, and a verifier's drain.

* A new session goes to the verifier with the least load as the verifiers report it, which counts
  every gateway's streams: streams another gateway holds (opened here straight on the verifier,
  as that gateway would) steer this gateway's new sessions away, though it holds none itself.
* A session stays on its verifier while that verifier is up, however loaded.
* A draining verifier finishes the round in flight, then refuses every request (UNAVAILABLE,
  ``draining``), says so in Stats, and stops once its streams are gone.

Rounds are held with events on the model thread, never with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading

import grpc
import pytest
from prometheus_client import REGISTRY

from common.errors import DRAINING
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.stack import BACKEND_METADATA, backend_channel, prompt, start_stack, wait_until


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama):
    st = start_stack(loop_thread, tiny_llama, verifiers=2)
    st.gateway_pair[1].backends.load_every = 0.0  # every placement asks the verifiers afresh
    yield st
    st.stop()


def moved(kind: str, reason: str) -> float:
    return REGISTRY.get_sample_value("racer_sessions_moved_total", {"kind": kind, "reason": reason}) or 0.0


@contextlib.contextmanager
def other_gateway_streams(target: str, n: int, tag: str, reserve: int = 0):
    """``n`` streams open on the verifier at ``target``, as another gateway's turns would hold them
    (each reserving KV memory for ``reserve`` new tokens)."""
    calls, channels = [], []
    try:
        for i in range(n):
            ch = backend_channel(target)
            channels.append(ch)
            q: queue.Queue = queue.Queue()
            op = vpb.VerifierOpen(session_id=f"{tag}{i}", tenant="other", history=prompt(i), reserve_tokens=reserve)
            q.put(vpb.VerifyRequest(open=op))
            call = vgrpc.VerifierStub(ch).Session(iter(q.get, None), timeout=60)
            next(call)  # opened: streaming until the call ends
            calls.append((call, q))
        yield
    finally:
        for call, q in calls:
            q.put(None)
            with contextlib.suppress(grpc.RpcError):
                for _ in call:
                    pass
        for ch in channels:
            ch.close()


def holder(st, sid: str) -> int:
    (i,) = [i for i in range(2) if any(s.session_id == sid for s in st.verifier_sessions(i))]
    return i


def test_new_sessions_go_to_the_verifier_all_gateways_load_least(stack, tiny_llama):
    for busy in (0, 1):
        with other_gateway_streams(stack.verifier_target(busy), 3, f"busy{busy}-"):
            wait_until(lambda b=busy: sum(s.streaming for s in stack.verifier_sessions(b)) == 3)
            with Client(stack.gateway, timeout=60) as c:
                p = prompt(50 + busy)
                ids, _, last = c.complete(p, max_new_tokens=8, budget=4)
            assert ids == hf_greedy(tiny_llama, p, 8)
            assert holder(stack, last.session_id) == 1 - busy


def test_a_session_stays_on_its_verifier_while_it_is_up(stack, tiny_llama):
    p1, p2 = prompt(60), prompt(61, n=4)
    with Client(stack.gateway, timeout=60) as c:
        ids1, _, last = c.complete(p1, max_new_tokens=8, budget=4)
        home = holder(stack, last.session_id)
        before = sum(moved("verifier", r) for r in ("drain", "lost", "unreachable", "gone", "full"))
        with other_gateway_streams(stack.verifier_target(home), 4, "crowd-"):
            ids2, _, _ = c.complete(p2, session_id=last.session_id, max_new_tokens=8, budget=4)
    assert ids2 == hf_greedy(tiny_llama, p1 + ids1 + p2, 8)
    assert holder(stack, last.session_id) == home
    assert sum(moved("verifier", r) for r in ("drain", "lost", "unreachable", "gone", "full")) == before


def _stats(target: str) -> vpb.VerifierStatsResponse:
    with grpc.insecure_channel(target) as ch:
        return vgrpc.VerifierStub(ch).Stats(vpb.VerifierStatsRequest(), timeout=10, metadata=BACKEND_METADATA)


def test_a_draining_verifier_finishes_the_round_in_flight_then_refuses(loop_thread, tiny_llama):
    st = start_stack(loop_thread, tiny_llama, verifiers=1)
    srv, core = st.verifiers[0]
    target = st.verifier_target(0)
    q: queue.Queue = queue.Queue()
    q.put(vpb.VerifyRequest(open=vpb.VerifierOpen(session_id="d", tenant="t", history=prompt(70))))
    release = threading.Event()
    try:
        with backend_channel(target) as ch:
            call = vgrpc.VerifierStub(ch).Session(iter(q.get, None), timeout=60)
            opened = next(call)
            assert not _stats(target).draining
            # The round in flight: its tree waits behind a job holding the model thread.
            hold = asyncio.run_coroutine_threadsafe(core._run(release.wait, 30), loop_thread.loop)
            wait_until(lambda: core.busy == 1, what="the model thread held")
            q.put(vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[opened.next_token], parents=[-1])))
            wait_until(lambda: core.busy == 2, what="the tree queued for the model thread")
            stopping = asyncio.run_coroutine_threadsafe(srv.stop(30), loop_thread.loop)
            wait_until(lambda: _stats(target).draining, what="Stats says draining")
            with backend_channel(target) as ch2:  # a new session is refused
                q2 = iter([vpb.VerifyRequest(open=vpb.VerifierOpen(session_id="n", tenant="t", history=prompt(71)))])
                with pytest.raises(grpc.RpcError) as refused:
                    next(vgrpc.VerifierStub(ch2).Session(q2, timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.value.details().startswith(DRAINING)
            release.set()
            hold.result(10)
            verified = next(call)  # the round in flight is answered
            assert len(verified.accepted) == 1
            q.put(vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[verified.next_token], parents=[-1])))
            with pytest.raises(grpc.RpcError) as ended:
                next(call)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert ended.value.details().startswith(DRAINING)
            q.put(None)
        stopping.result(30)  # its only stream ended: the drain is over, the server stopped
    finally:
        release.set()
        st.stop()
