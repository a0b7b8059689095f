"""A wedged model thread: health turns NOT_SERVING within the stall bound, new sessions are refused
with UNAVAILABLE and the gateway opens them on another verifier; SERVING again once it runs.

The thread is wedged by a job that waits on an Event; health changes are read from the standard
``grpc.health.v1`` Watch stream, never waited for with a sleep. The stall bound is 0 only while the
thread is wedged on purpose (any work not finished counts as a stall: the Event, not the clock,
decides when), and the default otherwise, so that no ordinary forward on a slow machine counts as one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc
from racer import launch as services
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.stack import INTERNAL_TOKEN, backend_channel, prompt, start_stack

WEDGED = 0.0  # seconds: the stall bound while the thread is wedged on purpose


def _watch(target: str):
    """The Verifier service's health statuses as they change (a blocking iterator)."""
    ch = grpc.insecure_channel(target)
    stream = health_pb2_grpc.HealthStub(ch).Watch(
        health_pb2.HealthCheckRequest(service="racer.v1.Verifier"), timeout=60
    )
    return ch, (health_pb2.HealthCheckResponse.ServingStatus.Name(r.status) for r in stream)


def _next_status(statuses, want: str) -> None:
    for got in statuses:
        if got == want:
            return
    raise AssertionError(f"health stream ended before {want}")


@contextlib.contextmanager
def stall_bound(core, seconds: float):
    before = core.stall_seconds
    core.stall_seconds = seconds
    try:
        yield
    finally:
        core.stall_seconds = before


@pytest.fixture
def verifier(loop_thread, tiny_llama):
    args = services.defaults("verifier", host="127.0.0.1", port=0, measure_cost=0, internal_token=INTERNAL_TOKEN)
    srv, core = loop_thread.run(services.start_verifier(args, model=tiny_llama))
    yield f"127.0.0.1:{srv.port}", core
    loop_thread.run(srv.stop(0))
    core.close()


def test_a_wedged_model_thread_turns_health_not_serving_and_refuses_new_sessions(verifier, loop_thread):
    target, core = verifier
    ch, statuses = _watch(target)
    gate = threading.Event()
    try:
        _next_status(statuses, "SERVING")
        req = vpb.VerifyRequest(open=vpb.VerifierOpen(session_id="s", tenant="t", history=prompt(1)))
        with stall_bound(core, WEDGED):
            wedge = asyncio.run_coroutine_threadsafe(
                core._run(gate.wait, 60, tenant="t", kind="hold"), loop_thread.loop
            )
            _next_status(statuses, "NOT_SERVING")
            with backend_channel(target) as vch:
                with pytest.raises(grpc.RpcError) as err:
                    list(vgrpc.VerifierStub(vch).Session(iter([req]), timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "stalled" in err.value.details()
            gate.set()
            wedge.result(30)
            _next_status(statuses, "SERVING")  # idle again: no stall, whatever the bound
        with backend_channel(target) as vch:
            assert len(list(vgrpc.VerifierStub(vch).Session(iter([req]), timeout=30))) == 1
    finally:
        gate.set()
        ch.close()


def test_the_gateway_opens_new_sessions_on_another_verifier_while_one_is_wedged(loop_thread, tiny_llama):
    st = start_stack(loop_thread, tiny_llama, verifiers=2)
    gate = threading.Event()
    try:
        wedged = st.verifiers[0][1]
        wedged.stall_seconds = WEDGED  # wedged until the gate opens; the other verifier keeps its default
        ch, statuses = _watch(st.verifier_target(0))
        _next_status(statuses, "SERVING")
        asyncio.run_coroutine_threadsafe(wedged._run(gate.wait, 60, tenant="x", kind="hold"), loop_thread.loop)
        _next_status(statuses, "NOT_SERVING")
        p = prompt(5)
        with Client(st.gateway, timeout=60) as c:
            ids, _, last = c.complete(p, max_new_tokens=16)
        assert ids == hf_greedy(tiny_llama, p, 16)
        assert [s.session_id for s in st.verifier_sessions(1)] == [last.session_id]
        assert st.verifier_sessions(0) == []
        # The gateway's open named the turn's new tokens: they were reserved with the history.
        kv = st.verifiers[1][1].kv_memory
        assert kv.peak >= kv.bytes_for(len(p) + 16 + st.verifiers[1][1].headroom)
        gate.set()
        _next_status(statuses, "SERVING")
        ch.close()
    finally:
        gate.set()
        st.stop()
