"""The store's lease and fenced compare-and-set, and the tenant quotas: the same answers from the
in-memory store (``racer generate``, tests) as from Redis (the Lua scripts replicas share)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from common.errors import Abort, Status
from common.store import MemoryStore, RedisStore
from gateway.quotas import Quota, Quotas, TenantLimits, load_tenant_limits


@pytest.fixture(params=["memory", "redis"])
def run(request, redis_url):
    """Runs ``test(store)`` on a store of the parameter's kind, in one event loop (keys and tenants
    carry a random prefix: the Redis is shared with other tests)."""

    def go(test):
        async def main():
            store = MemoryStore() if request.param == "memory" else RedisStore(redis_url)
            try:
                await test(store)
            finally:
                await store.close()

        asyncio.run(main())

    return go


def test_lease_and_fenced_set(run):
    L, K = f"{uuid.uuid4().hex}:L", f"{uuid.uuid4().hex}:K"

    async def go(store):
        assert await store.acquire(L, "t1", 30)
        assert not await store.acquire(L, "t2", 30)  # held
        assert await store.acquire(L, "t1", 30)  # a retry of the holder's own call (its first reply lost)
        assert not await store.renew(L, "t2", 30) and await store.renew(L, "t1", 30)
        # absent -> value only for the holder, and only while absent
        assert not await store.fenced_set(L, "t2", K, None, b"v1", 30)
        assert await store.fenced_set(L, "t1", K, None, b"v1", 30)
        assert not await store.fenced_set(L, "t1", K, None, b"v2", 30)
        # then only from the value the writer read
        assert not await store.fenced_set(L, "t1", K, b"other", b"v2", 30)
        assert await store.fenced_set(L, "t1", K, b"v1", b"v2", 30)
        assert await store.get(K) == b"v2"
        assert not await store.release(L, "t2") and await store.release(L, "t1")
        assert not await store.fenced_set(L, "t1", K, b"v2", b"v3", 30)  # released: fenced off
        assert await store.acquire(L, "t3", 0.05)
        while await store.get(L) is not None:  # the store's own TTL (Redis's clock) runs out
            await asyncio.sleep(0.01)
        assert not await store.renew(L, "t3", 30) and await store.acquire(L, "t4", 30)
        assert await store.get(K) == b"v2"

    run(go)


async def _call(op, fn, *args, retry=True):
    return await fn(*args)


class Clock:
    """The quotas' clock, moved by the test: a lease runs out when the test says, and never while a
    slow step runs."""

    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_quotas_admit_end_and_forget(run):
    a, b = f"a{uuid.uuid4().hex[:8]}", f"b{uuid.uuid4().hex[:8]}"
    limits = TenantLimits(Quota(0, 0, 0), ((a, Quota(sessions=2, tokens=100, turns=1)),))

    async def go(store):
        clock = Clock()
        q = Quotas(store, limits, 60.0, _call, clock=clock)

        async def refused(*args):
            with pytest.raises(Abort) as e:
                await q.admit(*args)
            assert e.value.code is Status.RESOURCE_EXHAUSTED
            return e.value.message

        await q.admit(a, "s1", 30, "t1", 30)
        assert "turns=1" in await refused(a, "s2", 10, "t2", 30)
        await q.admit(b, "s1", 10_000, "u1", 30)  # another tenant: no quota
        await q.end(a, "s1", "t1", "saved", 25, 30)
        assert await q.usage(a) == (1, 25, 0)
        await q.admit(a, "s2", 70, "t2", 30)
        assert await q.usage(a) == (2, 95, 1)
        await q.end(a, "s2", "t2", "new", 0, 70)  # not saved, never existed: stops counting
        assert await q.usage(a) == (1, 25, 0)
        await q.admit(a, "s2", 10, "t3", 30)
        await q.end(a, "s2", "t3", "saved", 10, 10)
        assert "sessions=2" in await refused(a, "s3", 1, "t4", 30)
        assert "tokens=100" in await refused(a, "s1", 91, "t4", 30)  # 10 held elsewhere + 91
        await q.admit(a, "s1", 90, "t4", 30)  # the session's own 25 are replaced, not added
        await q.end(a, "s1", "t4", "kept", 25, 90)  # failed turn: back to what the record holds
        assert await q.usage(a) == (2, 35, 0)
        # a turn whose lease expired ends after another turn of the session saved: the count stays the later one's
        await q.admit(a, "s2", 20, "t5", 30)
        await q.end(a, "s2", "t6", "saved", 15, 20)
        await q.end(a, "s2", "t5", "kept", 10, 20)
        assert await q.usage(a) == (2, 40, 0)
        await q.end(a, "s2", "t7", "saved", 10, 10)
        await q.forget(a, "s1")
        await q.end(a, "s1", "t-late", "saved", 50, 50)  # a late end of a closed session does not bring it back
        assert await q.usage(a) == (1, 10, 0)
        await q.admit(a, "s1", 5, "t5", 0.05)  # a turn whose gateway died stops counting when its lease ends
        assert (await q.usage(a))[2] == 1
        clock.advance(0.2)
        assert (await q.usage(a))[2] == 0

    run(go)


def test_a_dead_turns_new_session_stops_counting_with_its_lease_and_a_closed_session_is_not_readmitted(run):
    a = f"a{uuid.uuid4().hex[:8]}"
    limits = TenantLimits(Quota(sessions=2, tokens=0, turns=0))

    async def go(store):
        clock = Clock()
        q = Quotas(store, limits, 60.0, _call, clock=clock)
        # a new session's first turn whose gateway died (no renewal, no end): counted for its lease only
        await q.admit(a, "s1", 10, "t1", 0.05, new=True)
        await q.admit(a, "s2", 10, "t2", 0.05, new=True)
        assert (await q.usage(a))[0] == 2
        clock.advance(0.2)
        assert await q.usage(a) == (0, 0, 0)
        # renewed while it runs, a new session keeps counting past its first lease
        await q.admit(a, "s3", 10, "t3", 0.05, new=True)
        clock.advance(0.04)
        await q.renew(a, "s3", "t3", 60.0)
        clock.advance(0.2)
        assert (await q.usage(a))[0] == 1
        await q.end(a, "s3", "t3", "saved", 10, 10)
        # an existing session is admitted only while its record is there (closed since read: NOT_FOUND)
        rec = f"racer:session:{a}:s3"
        with pytest.raises(Abort) as e:
            await q.admit(a, "s3", 10, "t4", 30, new=False, record=rec)
        assert e.value.code is Status.NOT_FOUND
        await store.set(rec, b"{}", 30)
        await q.admit(a, "s3", 10, "t4", 30, new=False, record=rec)
        assert await q.usage(a) == (1, 10, 1)
        await store.delete(rec)

    run(go)


def test_one_call_sessions_count_only_while_their_turn_runs_and_never_as_kept(run):
    """A one-call session (closed after its turn: ``kept=False``) takes no kept-session slot, so a
    burst of them passes a full sessions quota; its reservation counts while its turn runs, and
    goes when the turn ends (saved or not) or its lease runs out (its gateway died)."""
    a = f"a{uuid.uuid4().hex[:8]}"
    limits = TenantLimits(Quota(sessions=2, tokens=1000, turns=0))

    async def go(store):
        clock = Clock()
        q = Quotas(store, limits, 60.0, _call, clock=clock)
        for i in range(2):  # the kept sessions fill the quota
            await q.admit(a, f"k{i}", 10, f"kt{i}", 30)
            await q.end(a, f"k{i}", f"kt{i}", "saved", 10, 10)
        for i in range(8):  # a burst of one-call sessions, all running at once
            await q.admit(a, f"c{i}", 50, f"ct{i}", 30, kept=False)
        assert await q.usage(a) == (2, 20 + 8 * 50, 8)
        with pytest.raises(Abort) as e:  # their tokens count against the tokens quota while they run
            await q.admit(a, "c8", 600, "ct8", 30, kept=False)
        assert "tokens=1000" in e.value.message
        for i in range(7):
            await q.end(a, f"c{i}", f"ct{i}", "call", 60, 50)
        assert await q.usage(a) == (2, 70, 1)
        clock.advance(31)  # the last one's gateway died: its turn and tokens go with its lease
        assert await q.usage(a) == (2, 20, 0)
        with pytest.raises(Abort) as e:  # a kept session is still refused, with when to retry
            await q.admit(a, "k2", 10, "kt2", 30)
        assert e.value.code is Status.RESOURCE_EXHAUSTED and "sessions=2" in e.value.message
        assert "without a session" in e.value.message and "CloseSession" in e.value.message
        assert 0 < e.value.retry_after <= 60 + 30 - 31 + 1

    run(go)


def test_quotas_random_sequences_agree_between_memory_and_redis(redis_url):
    limits = TenantLimits(Quota(3, 200, 2))
    rng = random.Random(7)
    ops = []
    for _ in range(300):
        sid, turn = f"s{rng.randrange(6)}", f"t{rng.randrange(4)}"
        kind = rng.choice(["admit", "admit", "end", "forget", "usage"])
        arg = rng.choice(["saved", "new", "kept", "call"])
        ops.append((kind, sid, turn, rng.randrange(1, 120), arg))

    tenant = f"x{uuid.uuid4().hex[:8]}"

    async def run(store):
        rng2 = random.Random(8)  # the same reservations for both stores
        q, out = Quotas(store, limits, 60.0, _call, clock=Clock()), []  # one instant: the same retry hints
        for kind, sid, turn, n, arg in ops:
            if kind == "admit":
                try:
                    await q.admit(tenant, sid, n, turn, 60, kept=arg != "call")
                    out.append("ok")
                except Abort as e:
                    out.append(e.message)
            elif kind == "end":
                await q.end(tenant, sid, turn, arg, n, rng2.randrange(1, 120))
            elif kind == "forget":
                await q.forget(tenant, sid)
            else:
                out.append(await q.usage(tenant))
        return out

    async def both():
        r = RedisStore(redis_url)
        try:
            return await run(MemoryStore()), await run(r)
        finally:
            await r.close()

    mem, red = asyncio.run(both())
    assert mem == red
    assert "ok" in mem and any("quota" in str(x) for x in mem)


def test_tenant_limits_file(tmp_path):
    f = tmp_path / "limits.toml"
    f.write_text("[default]\nsessions = 5\n\n[tenants.acme]\nturns = 2\n")
    lim = load_tenant_limits(str(f), Quota(1, 2, 3))
    assert lim.of("globex") == Quota(5, 2, 3) and lim.of("acme") == Quota(5, 2, 2)
    j = tmp_path / "limits.json"
    j.write_text('{"tenants": {"acme": {"tokens": 9}}}')
    assert load_tenant_limits(str(j), Quota(1, 2, 3)).of("acme") == Quota(1, 9, 3)
    for bad, msg in [
        ("[default]\nsesions = 5\n", "unknown key"),
        ("[default]\nsessions = -1\n", "sessions"),
        ('[tenants."a b"]\nturns = 1\n', "tenants.a b"),
        ("[other]\n", "only the tables"),
        ("[default\n", "limits.toml"),
    ]:
        f.write_text(bad)
        with pytest.raises(ValueError, match=msg):
            load_tenant_limits(str(f))


def test_the_limits_file_sets_a_tenants_corpus(tmp_path):
    f = tmp_path / "limits.toml"
    f.write_text("[default]\ncorpus_tokens = 5000\n[tenants.quiet]\nshare = false\n")
    limits = load_tenant_limits(str(f))
    assert limits.of("quiet").share is False and limits.of("quiet").corpus_tokens == 5000
    assert limits.of("other").share is True
    f.write_text("[tenants.quiet]\nshare = 0\n")
    with pytest.raises(ValueError, match="share"):
        load_tenant_limits(str(f))


def test_a_bad_tenant_limit_names_its_table_and_key(tmp_path):
    f = tmp_path / "limits.toml"
    for bad, where in [
        ("[tenants.acme]\nturns = true\n", "tenants.acme.turns"),  # a boolean is no count
        ("[default]\ncorpus_tokens = 1.5\n", "default.corpus_tokens"),
        ('[default]\nshare = "yes"\n', "default.share"),
        ("[tenants.acme]\nsessions = -3\n", "tenants.acme.sessions"),
    ]:
        f.write_text(bad)
        with pytest.raises(ValueError, match=rf"{f}: {where}: "):
            load_tenant_limits(str(f))
    with pytest.raises(ValueError):  # the settings' defaults are checked the same way
        Quota(sessions=True)


def test_the_limits_file_puts_tenants_in_a_prefix_sharing_group(tmp_path):
    f = tmp_path / "limits.toml"
    f.write_text('[tenants.acme]\nprefix_group = "org"\n[tenants.globex]\nprefix_group = "org"\n')
    limits = load_tenant_limits(str(f))
    assert limits.of("acme").prefix_group == limits.of("globex").prefix_group == "org"
    assert limits.of("initech").prefix_group == ""  # off by default: a tenant's blocks are its own
    for bad in ('prefix_group = "a:b"', "prefix_group = 1"):
        f.write_text(f"[tenants.acme]\n{bad}\n")
        with pytest.raises(ValueError, match="tenants.acme.prefix_group"):
            load_tenant_limits(str(f))
