"""Two gateways on one Redis: one writer per session (lease + fenced save) and per-tenant quotas
counted across both. Turns are held at their save point with an event, never with a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
from prometheus_client import REGISTRY

from gateway.requests import request_bytes
from racer.bench.loadgen import make_prompts, run_load
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.holds import held_rounds
from tests.support.stack import prompt, redis_server, start_stack, wait_until

AB, RE, NF = grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND
QUOTAS = ("sessions", "tokens", "turns")
# A turn's lease on its session: long, so that no turn loses it because a renewal came late on a
# busy machine. A test that needs a lease to run out or a renewal to come soon shortens it for the
# one turn whose outcome is the same whether the lease ran out on time or early.
LEASE_S = 30.0
SHORT_LEASE_S = 0.6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The API keys and tenant limits every gateway here reads."""
    d = tmp_path_factory.mktemp("replicas")
    (d / "keys").write_text("key-a acme\nkey-b globex\n")
    (d / "limits.toml").write_text("[default]\nturns = 8\n\n[tenants.acme]\nsessions = 3\ntokens = 400\nturns = 1\n")
    return d


@pytest.fixture(scope="module")
def env(loop_thread, tiny_llama, redis_url, files):
    d = files
    kw = dict(
        api_keys=str(d / "keys"),
        tenant_limits=str(d / "limits.toml"),
        lease_seconds=LEASE_S,
        max_sessions_kept=100,
        max_tokens_stored=100_000,
        queue_poll_seconds=300.0,
    )
    st = start_stack(loop_thread, tiny_llama, session_url=redis_url, snapshot_url=redis_url, **kw)
    second = st.another_gateway(tiny_llama.config.vocab_size, session_url=redis_url, **kw)
    gws = [st.gateway_pair, second]
    r = redis.Redis.from_url(redis_url)
    yield st, gws, r
    loop_thread.run(second[0].stop(0))
    st.stop()


def _target(gws, i: int) -> str:
    return f"127.0.0.1:{gws[i][0].port}"


def _record(r, tenant: str, sid: str) -> dict | None:
    data = r.get(f"racer:session:{tenant}:{sid}")
    return json.loads(data) if data is not None else None


@contextlib.contextmanager
def held_save(lt, gw, cut_streams: bool = False):
    """Holds every turn of gateway ``gw`` at its save point: yields (reached, release). ``cut_streams``:
    first closes the turn's drafter and verifier streams, as a gateway that died would."""
    orig = gw.records.save
    reached, go = threading.Event(), asyncio.Event()

    async def save(rec, lease=None):
        if cut_streams:
            await gw._turns[(rec.tenant, rec.session_id)].links.release(cancel=True)
        reached.set()
        await go.wait()
        return await orig(rec, lease)

    gw.records.save = save
    try:
        yield reached, lambda: lt.loop.call_soon_threadsafe(go.set)
    finally:
        gw.records.save = orig
        lt.loop.call_soon_threadsafe(go.set)


@contextlib.contextmanager
def short_lease(gw):
    """Turns that start on gateway ``gw`` inside take a lease of ``SHORT_LEASE_S``."""
    gw.lease_s = SHORT_LEASE_S
    try:
        yield
    finally:
        gw.lease_s = LEASE_S


def _status(fut) -> grpc.StatusCode:
    try:
        fut.result(60)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _nothing_left(r, tenant: str, sid: str) -> None:
    assert not r.exists(f"racer:session:{tenant}:{sid}"), "the record came back"
    assert not r.exists(f"racer:lease:{tenant}:{sid}"), "a lease was left behind"
    assert r.zscore(f"racer:quota:{tenant}:sessions", sid) is None, "the session still counts in the quota"
    assert not r.hexists(f"racer:quota:{tenant}:tokens", sid)


def test_close_on_b_during_a_turn_on_a_ends_it_and_nothing_resurrects(env, loop_thread):
    st, gws, r = env
    p = prompt(1, 10)
    with Client(_target(gws, 0), api_key="key-b", timeout=60) as a, Client(_target(gws, 1), api_key="key-b") as b:
        sid = a.complete(p, max_new_tokens=4)[2].session_id
        # a short lease: A's next renewal comes soon (expiring first would end the turn the same way)
        with (
            ThreadPoolExecutor(1) as pool,
            held_save(loop_thread, gws[0][1]) as (reached, release),
            short_lease(gws[0][1]),
        ):
            fut = pool.submit(a.complete, prompt(2, 4), session_id=sid, max_new_tokens=6)
            assert reached.wait(60), "the turn on A never reached its save"
            lost = REGISTRY.get_sample_value("racer_session_leases_lost_total") or 0
            info = b.close_session(sid)
            assert info.closed and info.turns == 1
            wait_until(  # A's next renewal finds its lease broken (the turn is held at its save meanwhile)
                lambda: REGISTRY.get_sample_value("racer_session_leases_lost_total") > lost, what="lease lost"
            )
            release()
            err = pytest.raises(grpc.RpcError, fut.result, 60)
        assert err.value.code() == AB and "closed" in err.value.details()
        _nothing_left(r, "globex", sid)
        for c in (a, b):
            with pytest.raises(grpc.RpcError) as e:
                c.complete([5], session_id=sid, max_new_tokens=2)
            assert e.value.code() == NF
    wait_until(lambda: not gws[0][1]._turns, what="A's turn ended")
    assert loop_thread.run(gws[0][1].quotas.usage("globex"))[2] == 0


def test_close_on_b_during_a_new_sessions_first_turn_on_a(env, loop_thread):
    st, gws, r = env
    with Client(_target(gws, 0), api_key="key-b", timeout=60) as a, Client(_target(gws, 1), api_key="key-b") as b:
        with ThreadPoolExecutor(1) as pool, held_save(loop_thread, gws[0][1]) as (reached, release):
            call = a.generate(prompt(40, 8), max_new_tokens=4)
            sid = next(call).session_id  # the session's id arrives with the first chunk, before any record
            fut = pool.submit(lambda: [x for x in call])
            assert reached.wait(60)
            assert _record(r, "globex", sid) is None
            info = b.close_session(sid)  # no record yet, but a running turn: closed all the same
            assert info.closed and info.turns == 0
            release()
            err = pytest.raises(grpc.RpcError, fut.result, 60)
        assert err.value.code() == AB
        _nothing_left(r, "globex", sid)
        with pytest.raises(grpc.RpcError) as e:
            a.complete([5], session_id=sid, max_new_tokens=2)
        assert e.value.code() == NF


def test_concurrent_turns_of_one_session_on_two_gateways(env, loop_thread, tiny_llama):
    st, gws, r = env
    p1, p2, p3 = prompt(3, 10), prompt(4, 4), prompt(5, 5)
    with Client(_target(gws, 0), api_key="key-b", timeout=60) as a, Client(_target(gws, 1), api_key="key-b") as b:
        ids1, _, last = a.complete(p1, max_new_tokens=5)
        sid = last.session_id
        with ThreadPoolExecutor(1) as pool, held_save(loop_thread, gws[0][1]) as (reached, release):
            fut = pool.submit(a.complete, p2, session_id=sid, max_new_tokens=6)
            assert reached.wait(60)
            with pytest.raises(grpc.RpcError) as e:  # the same session on the other gateway
                b.complete(p3, session_id=sid, max_new_tokens=3)
            assert e.value.code() == AB and "already running" in e.value.details()
            release()
            ids2 = fut.result(60)[0]
        rec = _record(r, "globex", sid)
        assert rec["turns"] == 2 and rec["history"] == p1 + ids1 + p2 + ids2
        assert ids2 == hf_greedy(tiny_llama, p1 + ids1 + p2, 6)
        ids3 = b.complete(p3, session_id=sid, max_new_tokens=3)[0]  # the lease was released: B goes on
        rec = _record(r, "globex", sid)
        assert rec["turns"] == 3 and rec["history"] == p1 + ids1 + p2 + ids2 + p3 + ids3
        assert b.close_session(sid).closed
    _nothing_left(r, "globex", sid)


def test_a_frozen_gateways_lease_expires_and_its_late_save_is_refused(env, loop_thread):
    st, gws, r = env
    gw_a = gws[0][1]
    p1, p2, p3 = prompt(6, 8), prompt(7, 4), prompt(8, 4)
    with Client(_target(gws, 0), api_key="key-b", timeout=60) as a, Client(_target(gws, 1), api_key="key-b") as b:
        ids1, _, last = a.complete(p1, max_new_tokens=4)
        sid = last.session_id
        store = gw_a.records.store
        renew = store.renew

        async def frozen(*_):  # A's renewals no longer reach Redis, as if A were stopped or cut off
            return True

        store.renew = frozen
        try:
            with (
                ThreadPoolExecutor(1) as pool,
                held_save(loop_thread, gw_a, cut_streams=True) as (reached, release),
                short_lease(gw_a),  # the lease A no longer renews runs out soon
            ):
                fut = pool.submit(a.complete, p2, session_id=sid, max_new_tokens=6)
                assert reached.wait(60)
                wait_until(lambda: not r.exists(f"racer:lease:globex:{sid}"), timeout=30, what="the lease expired")
                wait_until(
                    lambda: not any(s.streaming for s in st.drafter_sessions(0) + st.verifier_sessions(0)),
                    what="the backends saw A's streams end",
                )
                ids3 = b.complete(p3, session_id=sid, max_new_tokens=3)[0]  # B takes the session over
                release()
                err = pytest.raises(grpc.RpcError, fut.result, 60)
        finally:
            store.renew = renew
        assert err.value.code() == AB
        rec = _record(r, "globex", sid)  # B's turn, once; A's late turn neither lost B's nor was added
        assert rec["turns"] == 2 and rec["history"] == p1 + ids1 + p3 + ids3
        # the quota counts what B saved, not A's reservation nor the length A would have restored
        assert loop_thread.run(gws[1][1].quotas.usage("globex")) == (1, len(rec["history"]), 0)
        assert b.close_session(sid).closed
    _nothing_left(r, "globex", sid)


def test_quotas_are_counted_across_gateways(env, loop_thread):
    st, gws, r = env
    usage = [lambda gw=gw: loop_thread.run(gw[1].quotas.usage("acme")) for gw in gws]
    refused = {q: REGISTRY.get_sample_value("racer_quota_refusals_total", {"quota": q}) or 0 for q in QUOTAS}
    with (
        Client(_target(gws, 0), api_key="key-a", timeout=60) as a0,
        Client(_target(gws, 1), api_key="key-a", timeout=60) as a1,
        Client(_target(gws, 1), api_key="key-b", timeout=60) as b,
    ):
        sids = [c.complete(prompt(10 + i, 8), max_new_tokens=2)[2].session_id for i, c in enumerate((a0, a1, a0))]
        assert usage[0]() == usage[1]() == (3, 3 * 10, 0)
        # sessions=3: a fourth session is refused on either gateway; another tenant is not affected
        for c in (a0, a1):
            with pytest.raises(grpc.RpcError) as e:
                c.complete(prompt(20, 8), max_new_tokens=2)
            assert e.value.code() == RE and "sessions=3" in e.value.details()
        other = b.complete(prompt(21, 8), max_new_tokens=2)[2].session_id
        # tokens=400: a turn that could take acme past it is refused before it runs
        with pytest.raises(grpc.RpcError) as e:
            a1.complete(prompt(22, 8), session_id=sids[0], max_new_tokens=400)
        assert e.value.code() == RE and "tokens=400" in e.value.details()
        assert _record(r, "acme", sids[0])["turns"] == 1
        # turns=1: while one acme turn runs on A, an acme turn on B waits; the slot A frees admits it
        # (the gateways poll every 300 s: the store's notice does it), and another tenant never waits
        with ThreadPoolExecutor(2) as pool, held_save(loop_thread, gws[0][1]) as (reached, release):
            fut = pool.submit(a0.complete, prompt(23, 4), session_id=sids[0], max_new_tokens=3)
            assert reached.wait(60)
            assert usage[1]()[2] == 1
            waiting = pool.submit(a1.complete, prompt(24, 4), session_id=sids[1], max_new_tokens=2)
            wait_until(lambda: gws[1][1].queue.waiting("acme") == 1, timeout=30, what="B's acme turn queued")
            assert b.complete(prompt(25, 4), session_id=other, max_new_tokens=2)[0]
            assert not waiting.done() and usage[1]()[2] == 1
            release()
            assert _status(fut) == grpc.StatusCode.OK
            assert _status(waiting) == grpc.StatusCode.OK
        assert gws[1][1].queue.waiting("acme") == 0
        assert usage[1]() == (3, 3 * 10 + 4 + 3 + 4 + 2, 0)
        # closing a session on one gateway frees its place on both
        assert a1.close_session(sids[1]).closed
        assert usage[0]() == (2, 2 * 10 + 4 + 3, 0)
        sids[1] = a0.complete(prompt(26, 8), max_new_tokens=2)[2].session_id
        assert b.complete(prompt(27, 4), session_id=other, max_new_tokens=2)[0]  # B's session is still there
        for sid in sids:
            assert a0.close_session(sid).closed
        assert b.close_session(other).closed
    assert usage[0]() == (0, 0, 0)
    for q in ("sessions", "tokens"):  # each refusal counted (two sessions, one tokens; both gateways in-process)
        assert REGISTRY.get_sample_value("racer_quota_refusals_total", {"quota": q}) > refused[q]
    assert not r.keys("racer:quota:acme:*")  # emptied: the keys are gone
    for sid in sids:
        _nothing_left(r, "acme", sid)
    _nothing_left(r, "globex", other)


def test_the_gateway_refuses_a_message_larger_than_any_valid_request(env):
    st, gws, r = env
    gw = gws[0][1]
    assert request_bytes(gw.limits) < 16 * 1024 * 1024  # under the common --max-message-bytes default
    with Client(_target(gws, 0), api_key="key-a", timeout=60) as a:
        with pytest.raises(grpc.RpcError) as e:  # one byte per id: just over what a valid request needs
            a.complete([7] * (request_bytes(gw.limits) + 1), max_new_tokens=2)
        assert e.value.code() == RE and "message" in e.value.details().lower()
        with pytest.raises(grpc.RpcError) as e:  # under it: read, and refused by the token limit
            a.complete([7] * (gw.limits.max_prompt_tokens + 1), max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_tokens" in e.value.details()


def test_load_with_two_tenants_through_two_gateways(env, tiny_llama):
    st, gws, r = env
    sessions, turns, new, plen = 16, 3, 8, 6
    targets = f"{_target(gws, 0)},{_target(gws, 1)}"
    # acme's turns are held (after their open) until one of them waits for acme's one slot: its
    # concurrent turns do meet, however fast the machine runs a turn before the next one arrives.
    with held_rounds(st.lt, [core for _, core in st.verifiers], tenants=["acme"]) as hold:

        def release_once_one_waits():
            try:
                wait_until(
                    lambda: any(gw.queue.waiting("acme") for _, gw in gws), timeout=120, what="an acme turn queued"
                )
            finally:
                hold.release()

        releaser = threading.Thread(target=release_once_one_waits, daemon=True)
        releaser.start()
        report = asyncio.run(
            run_load(targets, sessions, turns, new, seed=3, ids_vocab=96, prompt_tokens=plen, api_key="key-a,key-b")
        )
        releaser.join(60)
    print(report.format())
    # acme (tenant1: sessions=3, turns=1) meets its quotas; globex (tenant2) is never refused
    assert set(report.errors) <= {"RESOURCE_EXHAUSTED"} and set(report.tenant_errors) <= {"tenant1"}
    assert report.tenant_errors.get("tenant1"), "acme's quota was never reached: the test could not fail"
    # acme's turns=1: its concurrent turns waited for the slot rather than being refused, and said so
    assert report.queued_turns > 0 and report.queue_ms["p50"] > 0 and "queued" in report.format()
    assert report.refused == report.errors.get("RESOURCE_EXHAUSTED", 0)
    assert all("turns=1" not in t.error for run in report.runs for t in run.turns)
    prompts = make_prompts(sessions, turns, 3, 96, plen)
    done = 0
    for i, run in enumerate(report.runs):
        history: list[int] = []
        for t, turn in enumerate(run.turns):
            if turn.error:
                assert run.tenant == 0 and "quota" in turn.error
                break
            history += prompts[i][t]
            assert turn.ids == hf_greedy(tiny_llama, history, new), f"session {i} turn {t}"
            history += turn.ids
            done += 1
        if run.tenant == 1:
            assert len(run.turns) == turns and not run.turns[-1].error
    assert done == report.completed_turns
    for run in report.runs:  # closed at the end: nothing left in Redis
        if run.session_id:
            tenant = ("acme", "globex")[run.tenant]
            _nothing_left(r, tenant, run.session_id)
            assert not r.exists(f"racer:drafter:{tenant}:{run.session_id}")
    assert not r.keys("racer:quota:acme:*") and not r.keys("racer:quota:globex:*")


def test_a_full_store_refuses_new_work_and_evicts_nobody(env, files, loop_thread, tiny_llama):
    st, gws, _ = env
    with redis_server() as url:
        r = redis.Redis.from_url(url)
        r.config_set("maxmemory-policy", "noeviction")
        srv, gw = st.another_gateway(
            tiny_llama.config.vocab_size,
            session_url=url,
            api_keys=str(files / "keys"),
            max_sessions_kept=0,
            max_tokens_stored=0,
        )
        target = f"127.0.0.1:{srv.port}"
        try:
            with Client(target, api_key="key-a", timeout=60) as a, Client(target, api_key="key-b", timeout=60) as b:
                p = prompt(30, 8)
                ids, _, last = b.complete(p, max_new_tokens=3)
                sid_b = last.session_id
                r.set("filler", b"x" * (256 * 1024))  # other data
                r.connection_pool.disconnect()  # frees the connection's 256 KiB query buffer
                r.config_set("maxmemory", r.info("memory")["used_memory"] + 48 * 1024)  # room for a few sessions
                mine, err = [], None
                for i in range(400):  # tenant A fills the store
                    try:
                        mine.append(a.complete(prompt(100 + i, 900), max_new_tokens=2)[2].session_id)
                    except grpc.RpcError as e:
                        err = e
                        break
                assert err is not None and err.code() == RE and "session store full" in err.details()
                assert mine, "the store was full before tenant A wrote anything: the test could not tell"
                print(f"tenant A stored {len(mine)} sessions before the store was full")
                assert _record(r, "globex", sid_b)["history"] == p + ids  # B's session was not evicted
                for sid in mine:  # closing works on a full store, and frees it
                    assert a.close_session(sid).closed
                p2 = prompt(31, 4)
                ids2 = b.complete(p2, session_id=sid_b, max_new_tokens=3)[0]
                assert ids2 == hf_greedy(tiny_llama, p + ids + p2, 3)
                assert _record(r, "globex", sid_b)["turns"] == 2
        finally:
            loop_thread.run(srv.stop(0))


def test_large_inputs_are_read_off_the_event_loop(env, loop_thread, monkeypatch):
    import gateway.core as core

    threads = []

    def spy(r, *args):
        threads.append(threading.get_ident())
        raise core.Abort(core.Status.INVALID_ARGUMENT, "spied")

    monkeypatch.setattr(core, "input_ids", spy)
    st, gws, r = env
    with Client(_target(gws, 0), api_key="key-b", timeout=60) as b:
        for n in (8, 3000):  # a small request on the loop (no thread hop), a large one in a worker thread
            with pytest.raises(grpc.RpcError) as e:
                b.complete([7] * n, max_new_tokens=2)
            assert "spied" in e.value.details()
    assert threads[0] == loop_thread.thread.ident and threads[1] != loop_thread.thread.ident
