"""Nothing read from the store is trusted: a poisoned drafter snapshot or session record, and a bug
in a handler, each end in a clear, bounded outcome through real services and a real Redis."""

from __future__ import annotations

import json

import grpc
import pytest
import redis
from prometheus_client import REGISTRY

from drafter.core import snapshot_key
from gateway.records import record_key
from racer.client import Client
from tests.support import snapshots as snaps
from tests.support.engine import hf_greedy
from tests.support.stack import prompt, start_stack


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama, redis_url):
    st = start_stack(loop_thread, tiny_llama, drafters=1, snapshot_url=redis_url, session_url=redis_url)
    yield st
    st.stop()


def _value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _poison_snapshot_then_continue(stack, tiny_llama, redis_url, seed: int, poison) -> None:
    """Turn 1; the drafter saves its snapshot and forgets the session; the snapshot is replaced by
    ``poison(snapshot)``; turn 2 must restore, refuse it, rebuild from history, and stay greedy."""
    lt, drafter = stack.lt, stack.drafters[0][1]
    r = redis.Redis.from_url(redis_url)
    p1, p2 = prompt(seed), prompt(seed + 1, n=5)
    with Client(stack.gateway, timeout=60) as c:
        ids1, _, last = c.complete(p1, max_new_tokens=12, budget=8)
        sid = last.session_id
        lt.run(drafter.flush())  # the turn's snapshot is in Redis and no write is pending
        key = snapshot_key("local", sid)
        good = r.get(key)
        assert good is not None
        ttl = drafter.ttl
        drafter.ttl = 0.0
        try:
            lt.run(drafter.expire())  # the next open must read the snapshot
        finally:
            drafter.ttl = ttl
        assert sid not in {s.session_id for s in drafter.stats()}
        bad = poison(good)
        r.set(key, bad)
        failures = _value("racer_snapshot_failures_total", op="restore")
        rebuilt = _value("racer_drafter_restores_total", source="new")
        ids2, _, last = c.complete(p2, session_id=sid, max_new_tokens=20, budget=8)  # 60 s deadline
    assert ids2 == hf_greedy(tiny_llama, p1 + ids1 + p2, 20)
    assert _value("racer_snapshot_failures_total", op="restore") == failures + 1
    assert _value("racer_drafter_restores_total", source="new") == rebuilt + 1
    lt.run(drafter.flush())
    assert r.get(key) != bad and snaps.unpack(r.get(key))["history"].size > 0  # replaced by a good one


def test_a_snapshot_with_a_cycle_is_discarded_and_the_session_rebuilt(stack, tiny_llama, redis_url):
    _poison_snapshot_then_continue(stack, tiny_llama, redis_url, 300, snaps.with_cycle)


def test_a_zip_bomb_snapshot_is_discarded_unread(stack, tiny_llama, redis_url):
    _poison_snapshot_then_continue(stack, tiny_llama, redis_url, 310, snaps.zip_bomb)


BAD_RECORDS = {
    "history of strings": lambda d: {**d, "history": [str(t) for t in d["history"]]},
    "token outside the vocabulary": lambda d: {**d, "history": d["history"] + [10**6]},
    "turns not an int": lambda d: {**d, "turns": "2"},
    "unknown field": lambda d: {**d, "admin": True},
    "missing field": lambda d: {k: v for k, v in d.items() if k != "verifier"},
    "another tenant's": lambda d: {**d, "tenant": "globex"},
    "another session's": lambda d: {**d, "session_id": "someone-else"},
    "a list": lambda d: [d],
}


def test_a_corrupt_session_record_is_data_loss_and_the_gateway_stays_healthy(stack, redis_url):
    r = redis.Redis.from_url(redis_url)
    with Client(stack.gateway, timeout=30) as c:
        sid = c.complete(prompt(320), max_new_tokens=3)[2].session_id
        key = record_key("local", sid)
        good = json.loads(r.get(key))
        for case, forge in [*BAD_RECORDS.items(), ("not JSON", None)]:
            r.set(key, b"\xff{" if forge is None else json.dumps(forge(good)))
            counted = _value("racer_session_records_corrupt_total")
            data_loss = _value("racer_requests_total", code="DATA_LOSS")
            with pytest.raises(grpc.RpcError) as e:
                c.complete([5, 6], session_id=sid, max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.DATA_LOSS, (case, e.value.code(), e.value.details())
            assert sid in e.value.details() and "corrupt" in e.value.details()
            assert "history" not in e.value.details() and "Error" not in e.value.details(), case
            assert _value("racer_requests_total", code="DATA_LOSS") == data_loss + 1
            with pytest.raises(grpc.RpcError) as e:
                c.get_session(sid)
            assert e.value.code() == grpc.StatusCode.DATA_LOSS
            assert sid not in {s.session_id for s in c.list_sessions()}
            assert _value("racer_session_records_corrupt_total") >= counted + 3, case
        # the gateway still serves, and the corrupt session can be closed
        assert c.complete(prompt(321), max_new_tokens=3)[0]
        assert c.close_session(sid).closed
        assert not r.exists(key)
        with pytest.raises(grpc.RpcError) as e:
            c.get_session(sid)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_bug_in_the_gateway_is_internal_without_details_and_counted(stack, monkeypatch):
    gateway = stack.gateway_pair[1]

    async def broken(tenant, session_id):
        raise RuntimeError("secret: redis://admin:hunter2@10.0.0.5")

    monkeypatch.setattr(gateway.records, "load", broken)
    before = _value("racer_requests_total", code="INTERNAL"), _value("racer_requests_total", code="OK")
    with Client(stack.gateway, timeout=30) as c:
        for call in (lambda: c.complete([5, 6], session_id="abc", max_new_tokens=2), lambda: c.get_session("abc")):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "hunter2" not in e.value.details() and "internal error" in e.value.details()
    assert (_value("racer_requests_total", code="INTERNAL"), _value("racer_requests_total", code="OK")) == (
        before[0] + 1,
        before[1],
    )
