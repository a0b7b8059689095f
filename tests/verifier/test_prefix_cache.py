"""The verifier's prefix cache (verifier/prefix_cache.py): scoped per tenant, inside KV memory,
and exact.

The ``Verifier`` core runs on its own event loop with the tiny Llama (512 bytes a cached token in
float32) and 16-token blocks. A block is copied into the cache on the model thread after the
prefill that computed it: ``_settled`` waits for that job by queueing one more of the tenant's
(a tenant's jobs run in order), never by time.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch
from prometheus_client import REGISTRY

from common.prefix import chain_keys, group_scope
from tests.support.aio import until
from tests.support.engine import hf_greedy
from tests.support.stack import prompt
from tests.verifier.test_batch_invariance import VOCAB, make_wide_llama
from verifier import native
from verifier.engine import VerifierSession
from verifier.prefix_cache import PrefixCache
from verifier.sessions import PREFIX_KEY, Open, Verifier

PER_TOKEN = 512
BLOCK = 16
SYSTEM = prompt(1, 4 * BLOCK)  # a system prompt of four blocks, the same for every tenant
N = 12  # tokens decoded per session


class UnscopedPrefixCache(PrefixCache):
    """The negative control: a cache keyed without the scope (every tenant in one namespace)."""

    def scope_key(self, scope: str) -> str:
        return ""


def _verifier(model, rows: int = 4096, **kw) -> Verifier:
    kw.setdefault("headroom", 8)
    return Verifier(model, kv_memory_bytes=rows * PER_TOKEN, prefix_block=BLOCK, **kw)


def _metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _counts() -> tuple[float, float, float]:
    return (
        _metric("racer_verifier_prefix_cache_lookups_total", outcome="hit"),
        _metric("racer_verifier_prefix_cache_lookups_total", outcome="miss"),
        _metric("racer_verifier_prefix_cache_saved_tokens_total"),
    )


async def _settled(v: Verifier, tenant: str) -> None:
    await v._run(lambda: None, tenant=tenant)


async def _session(v: Verifier, tenant: str, sid: str, history: list[int], n: int = N, scope: str = ""):
    """Opens a session and decodes ``n`` greedy tokens one at a time: (tokens, the open's result)."""
    e = v.claim(Open(tenant, sid, history, scope=scope))
    opened = await v.open(e, history, reserve_tokens=n)
    out = [opened.next_token]
    while len(out) < n:
        out.append((await v.verify(e, [out[-1]], [-1])).next_token)
    v.release(e)
    await _settled(v, tenant)
    return out, opened


def _accounted(v: Verifier) -> None:
    """The cache's bytes are its reservation, and every reservation is within KV memory."""
    mem = v.kv_memory
    assert mem.held.get(PREFIX_KEY, 0) == len(v.prefix) * v.prefix.block_bytes
    assert mem.used == sum(mem.held.values()) <= mem.total
    assert mem.peak <= mem.total


def _chains_closed(cache: PrefixCache) -> None:
    """Every cached block's parent is cached: eviction takes chain tails before their heads."""
    for b in cache.blocks.values():
        assert b.parent is None or b.parent in cache.blocks


def test_a_key_names_the_scope_and_every_token_before_it():
    a = chain_keys("a", SYSTEM, BLOCK)
    assert len(a) == 4 and len(set(a)) == 4
    assert chain_keys("a", SYSTEM + [5] * (BLOCK - 1), BLOCK) == a  # a partial block has no key
    assert not set(chain_keys("b", SYSTEM, BLOCK)) & set(a)
    edited = [SYSTEM[0] + 1, *SYSTEM[1:]]
    assert not set(chain_keys("a", edited, BLOCK)) & set(a)  # an early token changes every later key
    assert chain_keys("a", SYSTEM[:BLOCK] + edited[BLOCK:], BLOCK)[0] == a[0]


def _b_finds_nothing_of_a(v: Verifier) -> None:
    """The isolation test: tenant b's first session finds nothing of tenant a's, and prefills it all."""

    async def go():
        await _session(v, "a", "a1", SYSTEM + prompt(2, 7))
        hits, misses, _ = _counts()
        _, opened = await _session(v, "b", "b1", SYSTEM + prompt(3, 7))
        assert opened.prefix_tokens == 0, "tenant b was given tenant a's rows"
        assert _counts()[:2] == (hits, misses + 1)

    asyncio.run(go())


def test_two_tenants_with_one_system_prompt_share_nothing_and_a_tenants_second_session_hits(tiny_llama):
    v = _verifier(tiny_llama)

    async def go():
        hits0, misses0, saved0 = _counts()
        a1, o1 = await _session(v, "a", "a1", SYSTEM + prompt(2, 7))
        assert (o1.prefix_tokens, _counts()) == (0, (hits0, misses0 + 1, saved0))
        assert len(v.prefix) == 4  # its four full blocks, copied after its prefill
        b1, ob = await _session(v, "b", "b1", SYSTEM + prompt(3, 7))
        assert (ob.prefix_tokens, ob.reused_tokens, _counts()) == (0, 0, (hits0, misses0 + 2, saved0))
        assert len(v.prefix) == 8  # b's own copy of the same tokens, under its own keys
        a2_prompt = SYSTEM + prompt(4, 9)
        a2, o2 = await _session(v, "a", "a2", a2_prompt)
        assert o2.prefix_tokens == 4 * BLOCK and o2.reused_tokens == 0
        assert _counts() == (hits0 + 1, misses0 + 2, saved0 + 4 * BLOCK)
        # float32: every session's output is transformers' greedy output
        assert a1 == hf_greedy(tiny_llama, SYSTEM + prompt(2, 7), N)
        assert b1 == hf_greedy(tiny_llama, SYSTEM + prompt(3, 7), N)
        assert a2 == hf_greedy(tiny_llama, a2_prompt, N)
        _accounted(v)
        v.close()

    asyncio.run(go())


def test_the_hf_backend_takes_cached_rows_too(tiny_llama):
    v = _verifier(tiny_llama, backend="hf")

    async def go():
        await _session(v, "a", "a1", SYSTEM + prompt(2, 7))
        p = SYSTEM + prompt(4, 9)
        out, opened = await _session(v, "a", "a2", p)
        assert opened.prefix_tokens == 4 * BLOCK
        assert out == hf_greedy(tiny_llama, p, N)
        v.close()

    asyncio.run(go())


def test_isolation_holds_with_the_scoped_cache(tiny_llama):
    v = _verifier(tiny_llama)
    _b_finds_nothing_of_a(v)
    v.close()


def test_isolation_fails_with_a_cache_keyed_without_the_tenant(tiny_llama):
    """Negative control: the same test catches a cache that forgets the tenant."""
    v = _verifier(tiny_llama)
    v.prefix = UnscopedPrefixCache(v.prefix.block_bytes, BLOCK)
    with pytest.raises(AssertionError, match="tenant b was given tenant a's rows"):
        _b_finds_nothing_of_a(v)
    v.close()


def test_tenants_of_one_sharing_group_share_blocks(tiny_llama):
    v = _verifier(tiny_llama)

    async def go():
        await _session(v, "a", "a1", SYSTEM + prompt(2, 7), scope=group_scope("org"))
        b_prompt = SYSTEM + prompt(3, 7)
        out, opened = await _session(v, "b", "b1", b_prompt, scope=group_scope("org"))
        assert opened.prefix_tokens == 4 * BLOCK
        assert out == hf_greedy(tiny_llama, b_prompt, N)
        _, alone = await _session(v, "c", "c1", SYSTEM + prompt(5, 7))  # not in the group
        assert alone.prefix_tokens == 0
        v.close()

    asyncio.run(go())


def test_a_follow_up_and_a_re_prefill_after_eviction_take_the_cached_prefix(tiny_llama):
    v = _verifier(tiny_llama)

    async def go():
        first = SYSTEM + prompt(2, 7)
        out, _ = await _session(v, "a", "s", first)
        assert v.drop("a", "s")  # an evicted (or moved) session comes back with its whole history
        history = first + out[:-1] + prompt(6, 5)
        again, opened = await _session(v, "a", "s", history)
        assert opened.prefix_tokens == 4 * BLOCK  # the system prompt's blocks; the rest is prefilled
        assert again == hf_greedy(tiny_llama, history, N)
        v.close()

    asyncio.run(go())


def test_the_cache_is_evicted_at_the_bound_tails_first_and_gives_way_to_sessions(tiny_llama):
    """KV memory of 240 rows: a session's 79-token prompt (88 rows reserved with the turn and the
    headroom, 82 kept idle) and its four cached blocks (64 rows) leave too little for the next
    tenant's session, which takes the oldest blocks' memory, tails first."""
    v = _verifier(tiny_llama, rows=240)

    async def go():
        evicted = _metric("racer_verifier_prefix_cache_evicted_blocks_total")
        out_a, _ = await _session(v, "a", "a1", SYSTEM + prompt(2, 15), n=2)
        assert len(v.prefix) == 4
        _accounted(v)
        for i, tenant in enumerate("bcd"):
            p = prompt(10 + i, 79)
            out, _ = await _session(v, tenant, f"{tenant}1", p, n=2)
            assert out == hf_greedy(tiny_llama, p, 2)
            _accounted(v)
            _chains_closed(v.prefix)
        assert _metric("racer_verifier_prefix_cache_evicted_blocks_total") > evicted
        assert v.kv_memory.peak <= v.kv_memory.total
        v.close()

    asyncio.run(go())


def test_blocks_being_copied_into_a_session_are_never_evicted(tiny_llama):
    """Tenant a's second session has pinned the cached blocks it copies, and the model thread is
    held before the copy runs: another tenant's open that needs their memory evicts everything else
    it may, then waits; the pinned blocks stay, and the session's output is exact."""
    v = _verifier(tiny_llama, rows=300, wait_seconds=60)

    async def go():
        await _session(v, "a", "a1", SYSTEM + prompt(2, 7), n=2)
        await _session(v, "a", "a2", SYSTEM + prompt(7, 7), n=2)  # the blocks, and an idle session, again
        loop = asyncio.get_running_loop()
        held, gate = asyncio.Event(), threading.Event()

        def hook(event, job):
            if event == "start" and job.kind == "prefill" and job.tenant == "a" and not held.is_set():
                loop.call_soon_threadsafe(held.set)
                gate.wait(60)

        v.model_thread.hooks.append(hook)
        p = SYSTEM + prompt(8, 9)
        copying = asyncio.ensure_future(_session(v, "a", "a3", p))
        await held.wait()
        pinned = [b for b in v.prefix.blocks.values() if b.pins]
        assert len(pinned) == 4
        big = prompt(20, 200)
        other = asyncio.ensure_future(_session(v, "c", "c1", big, n=2))
        await until(lambda: v.kv_memory.waiting == 1)
        assert all(v.prefix.blocks.get(b.key) is b for b in pinned)
        assert len(v.prefix) == 4  # the unpinned blocks went first, then the idle sessions
        assert sorted(e.session_id for e in v.sessions) == ["a3", "c1"]  # a1, a2 evicted; c1 waits
        _accounted(v)
        gate.set()
        out, opened = await copying
        assert opened.prefix_tokens == 4 * BLOCK and out == hf_greedy(tiny_llama, p, N)
        out_c, _ = await other  # admitted once a3's cache is idle and evictable
        assert out_c == hf_greedy(tiny_llama, big, 2)
        _accounted(v)
        v.close()

    asyncio.run(go())


# -- reduced precision: bit for bit ----------------------------------------------------------------


def native_tile() -> str | None:
    usable = [n for n in native.VARIANTS if n not in native.PAIRS and native.usable(n)]
    return usable[0] if usable else None


needs_native = pytest.mark.skipif(
    native_tile() is None or not native.attention_usable(torch.bfloat16, torch.device("cpu"), 64),
    reason=f"native kernels not built here: {native.why()}",
)


@pytest.fixture(scope="module")
def bf16_fused(tmp_path_factory):
    """SmolLM2's head size in bfloat16 on the native decoder (a native row tile forced)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RACER_KERNELS", native_tile() or "linear")
    mp.setenv("RACER_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield make_wide_llama(dtype=torch.bfloat16)
    mp.undo()


def _wide_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@needs_native
def test_cached_rows_are_bit_identical_to_a_full_prefills(bf16_fused):
    """Row invariance: the rows of a prompt's first blocks, prefilled alone and copied into another
    cache, are the bits a full prefill of the whole prompt writes, and so is everything after."""
    p = _wide_prompt(1, 150)
    full = VerifierSession(bf16_fused, backend="llama")
    assert full.backend.fused is not None and full.prefix_exact
    want = full.prefill(p)
    donor = VerifierSession(bf16_fused, backend="llama")
    donor.prefill(p[:128] + _wide_prompt(2, 30))  # another session of the tenant: same 128, then others
    got = VerifierSession(bf16_fused, backend="llama")
    got.write_rows(donor.read_rows(0, 100))
    got.write_rows(donor.read_rows(64, 128), skip=36)  # the second block past what the session holds
    res = got.prefill(p[128:])
    assert torch.equal(got.backend.cache[:, :, :, :150], full.backend.cache[:, :, :, :150])
    assert res.next_token == want.next_token and res.topk == want.topk[128:]


@needs_native
def test_bf16_outputs_with_the_cache_equal_outputs_without_it_bit_for_bit(bf16_fused):
    on, off = _verifier(bf16_fused, rows=8192), _verifier(bf16_fused, rows=8192, prefix_cache=False)
    system = _wide_prompt(3, 100)

    async def go():
        outs = {}
        for name, v in (("on", on), ("off", off)):
            runs = []
            for i in range(3):
                p = system + _wide_prompt(10 + i, 11)
                out, opened = await _session(v, "t", f"s{i}", p, n=16)
                runs.append((out, opened.topk, opened.prefix_tokens))
            outs[name] = runs
        assert [r[2] for r in outs["on"]] == [0, 96, 96] and [r[2] for r in outs["off"]] == [0, 0, 0]
        for (o_on, topk_on, _), (o_off, topk_off, _) in zip(outs["on"], outs["off"]):
            assert o_on == o_off
            assert topk_on == topk_off[len(topk_off) - len(topk_on) :]  # the rows it prefilled
        a, b = on.sessions.get(("t", "s2")), off.sessions.get(("t", "s2"))
        n = len(a.tokens)
        assert torch.equal(a.session.backend.cache[:, :, :, :n], b.session.backend.cache[:, :, :, :n])
        on.close()
        off.close()

    asyncio.run(go())


def test_the_op_by_op_invariant_path_takes_no_cached_rows(tmp_path, monkeypatch):
    """Without the native decoder a reduced-precision prompt attends in one fused call, whose rows
    depend on how the prompt is split: there the cache is not used (every prompt is prefilled)."""
    monkeypatch.setenv("RACER_KERNELS", "linear:4")
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    s = VerifierSession(make_wide_llama(dtype=torch.bfloat16), backend="llama")
    assert not s.prefix_exact
