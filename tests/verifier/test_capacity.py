"""The verifier's KV memory in bytes: reservations, the wait queue, eviction, caches giving rows back.

Each test drives the ``Verifier`` core on its own event loop with the tiny Llama (2 layers, 2 KV
heads of 16: 512 bytes a cached token in float32). Waits are held by the queue's own state (a
waiter counted), never by time.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import REGISTRY

from common.errors import Abort, Status
from tests.support.aio import until
from tests.support.engine import hf_greedy
from tests.support.stack import prompt
from verifier.engine import VerifierSession
from verifier.kv_memory import default_kv_bytes, kv_bytes_per_token, memory_limit, model_bytes
from verifier.sessions import Open, Verifier

PER_TOKEN = 512  # the tiny Llama: 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes
HISTORY = 20
HEADROOM = 8
ROWS = HISTORY + HEADROOM  # what one open reserves


def _verifier(model, sessions_fit: float = 3, **kw) -> Verifier:
    kw.setdefault("headroom", HEADROOM)
    return Verifier(model, kv_memory_bytes=int(sessions_fit * ROWS * PER_TOKEN), **kw)


def _metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _held_rows_fit(v: Verifier) -> None:
    """What every cache has allocated is within its reservation, and the reservations within the budget."""
    for e in v.sessions:
        cap = getattr(e.session.backend, "capacity", 0)
        assert cap * PER_TOKEN <= v.kv_memory.held.get(e.key, 0), (e.key, cap, v.kv_memory.held.get(e.key))
    assert v.kv_memory.used == sum(v.kv_memory.held.values()) <= v.kv_memory.total
    assert v.kv_memory.peak <= v.kv_memory.total


async def _opened(v, session_id: str, tokens: list[int]):
    """Claims and opens one of tenant ``t``'s sessions with ``tokens`` as its prompt."""
    e = v.claim(Open("t", session_id, tokens))
    await v.open(e, tokens)
    return e


def test_bytes_per_token_come_from_the_model_config(tiny_llama):
    assert kv_bytes_per_token(tiny_llama.config, 4) == PER_TOKEN
    assert kv_bytes_per_token(tiny_llama.config, 2) == PER_TOKEN // 2


def test_the_default_budget_is_a_share_of_the_cgroup_limit_left_after_the_weights(tiny_llama, tmp_path):
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    assert memory_limit(limit) is None
    limit.write_text("1073741824\n")
    assert memory_limit(limit) == 1 << 30
    assert (
        default_kv_bytes(tiny_llama, PER_TOKEN, 1000, 0.5, limit=1 << 30) == ((1 << 30) - model_bytes(tiny_llama)) // 2
    )
    with pytest.raises(ValueError, match="does not hold the model"):
        default_kv_bytes(tiny_llama, PER_TOKEN, 1000, limit=1000)


def test_without_a_limit_the_budget_is_max_cache_tokens_worth(tiny_llama, monkeypatch):
    import verifier.kv_memory as kv_memory

    monkeypatch.setattr(kv_memory, "memory_limit", lambda: None)
    assert default_kv_bytes(tiny_llama, PER_TOKEN, 1000) == 1000 * PER_TOKEN


def test_an_open_that_does_not_fit_waits_and_proceeds_when_another_session_closes(tiny_llama):
    async def go():
        v = _verifier(tiny_llama, sessions_fit=3.5)
        queued = _metric("racer_verifier_admissions_total", outcome="queued")
        held = []
        for i in range(3):
            e = v.claim(Open("t", f"s{i}", prompt(i, HISTORY)))
            await v.open(e, prompt(i, HISTORY))
            held.append(e)
            _held_rows_fit(v)
        fourth = prompt(3, HISTORY)
        e4 = v.claim(Open("u", "s3", fourth))
        task = asyncio.ensure_future(v.open(e4, fourth))
        await until(lambda: v.kv_memory.waiting == 1)
        assert not task.done()
        assert v.kv_memory.used <= v.kv_memory.total
        assert _metric("racer_verifier_kv_reserved_bytes") == v.kv_memory.used
        assert _metric("racer_verifier_admission_waiting") == 1
        v.release(held[0])  # idle now: the waiter's open evicts it
        res = await task
        ref = VerifierSession(tiny_llama)
        assert res.next_token == ref.prefill(fourth).next_token
        assert ("t", "s0") not in v.sessions
        assert _metric("racer_verifier_admissions_total", outcome="queued") == queued + 1
        _held_rows_fit(v)
        v.close()

    asyncio.run(go())


def test_a_dropped_session_frees_its_reservation_for_the_waiter(tiny_llama):
    async def go():
        v = _verifier(tiny_llama, sessions_fit=1.5)
        e1 = await _opened(v, "a", prompt(1, HISTORY))
        e2 = v.claim(Open("t", "b", prompt(2, HISTORY)))
        task = asyncio.ensure_future(v.open(e2, prompt(2, HISTORY)))
        await until(lambda: v.kv_memory.waiting == 1)
        assert v.drop("t", "a")  # CloseSession while its stream is still open
        await task
        assert set(v.kv_memory.held) == {("t", "b")}
        _held_rows_fit(v)
        v.release(e1)  # the dropped session's stream ends: nothing of it stays reserved
        assert set(v.kv_memory.held) == {("t", "b")}
        v.close()

    asyncio.run(go())


def test_a_request_that_can_never_fit_is_refused_at_once(tiny_llama):
    v = _verifier(tiny_llama, sessions_fit=2)
    never = _metric("racer_verifier_admissions_total", outcome="never_fits")
    with pytest.raises(Abort) as err:
        v.claim(Open("t", "huge", prompt(1, 2 * ROWS)))
    assert err.value.code == Status.RESOURCE_EXHAUSTED and "bytes of KV memory" in err.value.message
    assert v.kv_memory.waiting == 0 and v.kv_memory.used == 0 and len(v.sessions) == 0

    async def tree_too_big():  # a tree that could never fit, on a session that does
        e = await _opened(v, "s", prompt(2, HISTORY))
        n = 2 * ROWS
        with pytest.raises(Abort) as err:
            await v.verify(e, prompt(3, n), [-1, *range(n - 1)])
        assert err.value.code == Status.RESOURCE_EXHAUSTED
        assert _metric("racer_verifier_admissions_total", outcome="never_fits") == never + 1
        _held_rows_fit(v)
        v.close()

    asyncio.run(tree_too_big())


def test_the_wait_ends_at_the_deadline_and_a_full_queue_refuses_at_once(tiny_llama):
    async def go():
        v = _verifier(tiny_llama, sessions_fit=1.5, max_waiting=1)
        await _opened(v, "a", prompt(1, HISTORY))
        e2 = v.claim(Open("t", "b", prompt(2, HISTORY)))
        waiter = asyncio.ensure_future(v.open(e2, prompt(2, HISTORY), timeout=3600))
        await until(lambda: v.kv_memory.waiting == 1)
        e3 = v.claim(Open("t", "c", prompt(3, HISTORY)))
        with pytest.raises(Abort) as err:
            await v.open(e3, prompt(3, HISTORY))
        assert err.value.code == Status.RESOURCE_EXHAUSTED and "already wait" in err.value.message
        assert ("t", "c") not in v.sessions  # a refused new session leaves nothing behind
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert v.kv_memory.waiting == 0
        e4 = v.claim(Open("t", "d", prompt(4, HISTORY)))
        with pytest.raises(Abort) as err:
            await v.open(e4, prompt(4, HISTORY), timeout=0.0)  # the client's deadline has come
        assert err.value.code == Status.RESOURCE_EXHAUSTED and "waited" in err.value.message
        assert set(v.kv_memory.held) == {("t", "a")}
        v.close()

    asyncio.run(go())


def test_idle_caches_give_back_spare_rows_and_growth_stays_within_the_reservation(tiny_llama):
    """Greedy through the core, one-node trees: the cache grows by reservations only, the output is
    transformers' greedy output, and once idle the cache holds exactly its tokens."""

    async def go():
        v = _verifier(tiny_llama, sessions_fit=4)
        p = prompt(7, HISTORY)
        e = v.claim(Open("t", "g", p))
        res = await v.open(e, p)
        out = [res.next_token]
        for _ in range(3 * HEADROOM):  # past the headroom: two growths
            r = await v.verify(e, [out[-1]], [-1])
            out.append(r.next_token)
            _held_rows_fit(v)
        assert out == hf_greedy(tiny_llama, p, len(out))
        assert v.kv_memory.held[e.key] > len(e.tokens) * PER_TOKEN
        v.release(e)
        await v._run(lambda: None, tenant="t")  # after the trim: one tenant's jobs run in order
        assert e.session.backend.capacity == len(e.tokens)
        assert v.kv_memory.held[e.key] == len(e.tokens) * PER_TOKEN
        _held_rows_fit(v)
        v.close()

    asyncio.run(go())


def test_a_chunk_that_ran_on_after_its_stream_was_cancelled_is_trimmed_before_the_cache_shrinks(tiny_llama):
    """The open is cancelled while its second chunk runs on the model thread: that chunk still writes
    its rows, which ``entry.tokens`` does not count; once idle, the cache holds no row past its
    reservation."""

    async def go():
        v = _verifier(tiny_llama, sessions_fit=4, prefill_chunk=4)
        p = prompt(9, HISTORY)
        e = v.claim(Open("t", "cut", p))
        loop = asyncio.get_running_loop()
        second, gate = asyncio.Event(), threading.Event()
        chunks = []

        def hook(event, job):
            if event == "start" and job.kind == "prefill":
                chunks.append(job)
                if len(chunks) == 2:
                    loop.call_soon_threadsafe(second.set)
                    gate.wait(60)

        v.model_thread.hooks.append(hook)
        task = asyncio.ensure_future(v.open(e, p))
        await second.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        v.release(e)
        await v._run(lambda: None, tenant="t")  # after the chunk and the trim: one tenant's jobs run in order
        assert e.session.backend.length == e.session.backend.capacity == len(e.tokens)
        _held_rows_fit(v)
        v.close()

    asyncio.run(go())


def test_a_trimmed_cache_shrinks_to_its_new_history(tiny_llama):
    async def go():
        v = _verifier(tiny_llama, sessions_fit=4)
        long = prompt(8, 2 * HISTORY)
        e = v.claim(Open("t", "trim", long))
        await v.open(e, long)
        v.release(e)
        e = v.claim(Open("t", "trim", long[:HISTORY]))
        await v.open(e, long[:HISTORY])  # an edited history: the cache keeps a prefix
        assert e.session.backend.capacity == HISTORY + HEADROOM
        assert v.kv_memory.held[e.key] == (HISTORY + HEADROOM) * PER_TOKEN
        _held_rows_fit(v)
        v.close()

    asyncio.run(go())


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill_gives_the_unchunked_tokens(tiny_llama, chunk):
    """float32: a prompt prefilled in chunks continues exactly as transformers' greedy decoding, and
    its top-k rows are those of one prefill."""

    async def go():
        v = _verifier(tiny_llama, sessions_fit=8, prefill_chunk=chunk)
        p = prompt(11, 40)
        e = v.claim(Open("t", "c", p))
        res = await v.open(e, p)
        ref = VerifierSession(tiny_llama, backend="llama").prefill(p)
        assert res.next_token == ref.next_token
        assert res.topk == [t for row in ref.topk for t in row]
        out = [res.next_token]
        for _ in range(12):
            out.append((await v.verify(e, [out[-1]], [-1])).next_token)
        assert out == hf_greedy(tiny_llama, p, len(out))
        v.close()

    asyncio.run(go())


def test_an_open_reserves_the_turns_new_tokens_too(tiny_llama):
    async def go():
        v = _verifier(tiny_llama, sessions_fit=3)
        p = prompt(12, HISTORY)
        e = v.claim(Open("t", "r", p, reserve_tokens=ROWS))
        await v.open(e, p, reserve_tokens=ROWS)
        assert v.kv_memory.held[e.key] == (ROWS + ROWS) * PER_TOKEN
        assert e.session.backend.capacity == ROWS + ROWS
        with pytest.raises(Abort) as err:
            v.claim(Open("t", "neg", p, reserve_tokens=-1))
        assert err.value.code == Status.INVALID_ARGUMENT
        with pytest.raises(Abort) as err:  # fits alone, not with the new tokens it asks room for
            v.claim(Open("t", "big", p, reserve_tokens=3 * ROWS))
        assert err.value.code == Status.RESOURCE_EXHAUSTED and "new need" in err.value.message
        v.close()

    asyncio.run(go())


def test_a_kept_sessions_next_turns_grow_into_a_headroom_instead_of_moving_the_cache(tiny_llama):
    """A later turn that needs more rows than the cache holds grows it by one headroom more than it
    needs, where free memory allows: the turns after it fit without a new cache (each move zeroes
    one and copies the old). Where memory is short it takes exactly its need."""

    async def go():
        v = _verifier(tiny_llama, sessions_fit=4)
        p = prompt(13, HISTORY)
        e = await _opened(v, "grow", p)
        assert e.session.backend.capacity == ROWS  # a first open: exactly its need
        v.release(e)
        longer = p + prompt(14, 4)
        e = v.claim(Open("t", "grow", longer))
        await v.open(e, longer)
        grown = e.session.backend.cache
        assert e.session.backend.capacity == ROWS + 4 + HEADROOM  # the need, and a headroom to grow into
        v.release(e)
        longer = longer + prompt(15, 4)
        e = v.claim(Open("t", "grow", longer))
        res = await v.open(e, longer)
        assert e.session.backend.cache is grown  # fits: the same cache, nothing moved
        assert res.next_token == VerifierSession(tiny_llama, backend="llama").prefill(longer).next_token
        _held_rows_fit(v)
        v.release(e)
        v.close()

        tight = Verifier(tiny_llama, kv_memory_bytes=(ROWS + 4) * PER_TOKEN, headroom=HEADROOM)  # the need alone
        e = await _opened(tight, "tight", p)
        tight.release(e)
        e = tight.claim(Open("t", "tight", p + prompt(14, 4)))
        await tight.open(e, p + prompt(14, 4))
        assert e.session.backend.capacity == ROWS + 4
        _held_rows_fit(tight)
        tight.close()

    asyncio.run(go())
