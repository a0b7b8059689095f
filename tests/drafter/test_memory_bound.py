"""The drafter's memory bound in bytes: past it the least recently used idle sessions leave memory,
their snapshot written first, and they come back from it drafting exactly what they would have."""

from __future__ import annotations

import asyncio
import random

from common.store import MemoryStore
from drafter import metrics as M
from drafter.core import Drafter, Open, Step, snapshot_key
from drafter.corpora import Corpora
from drafter.draft_session import DrafterConfig

CFG = DrafterConfig(window=4, max_nodes=400, topk=3)
VOCAB = 12


def _history(seed: int, n: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


async def _turn(d: Drafter, sid: str, history: list[int]):
    """Opens the session with ``history``, drafts one tree, ends the turn: (source, tree)."""
    entry, source = await d.open(Open("t", sid, history, []))
    tree = d.step(entry, Step([], [], 0, history[-1], 16, "racer"))
    d.end_turn(entry)
    d.release(entry)
    return source, (list(tree.tokens), list(tree.parents))


def test_lru_idle_sessions_leave_memory_and_restore_from_their_snapshot():
    async def go():
        free = Drafter(CFG, MemoryStore())  # unbounded: what every session drafts
        want = {}
        for i in range(4):
            want[i] = (await _turn(free, f"s{i}", _history(i)))[1]
        sizes = {e.session_id: e.bytes for e in free.sessions}
        assert not any(sizes.values())  # max_bytes 0: nothing estimated, nothing evicted
        one = free.sessions.get(("t", "s0")).session.memory_estimate()
        store = MemoryStore()
        d = Drafter(CFG, store, max_bytes=int(2.5 * one))
        evicted = M.EVICTIONS._value.get()
        for i in range(4):
            assert await _turn(d, f"s{i}", _history(i)) == ("new", want[i])
        await d.flush()
        assert {e.session_id for e in d.sessions} == {"s2", "s3"}, "the two least recently used left"
        assert M.EVICTIONS._value.get() - evicted == 2
        assert d.memory_bytes() <= d.max_bytes
        assert all([await store.get(snapshot_key("t", f"s{i}")) for i in range(4)])
        # the next turn of an evicted session restores it and drafts what the unbounded drafter does
        more = _history(0) + _history(10, 20)
        got = await _turn(d, "s0", more)
        assert got == ("snapshot", (await _turn(free, "s0", more))[1])
        assert {e.session_id for e in d.sessions} == {"s3", "s0"} and d.memory_bytes() <= d.max_bytes
        # a session held by a stream is never evicted, even past the bound
        entry, _ = await d.open(Open("t", "s3", _history(3), []))
        d.max_bytes = 1
        await _turn(d, "s1", _history(1))
        assert {e.session_id for e in d.sessions} == {"s3", "s1"}
        d.release(entry)

    asyncio.run(go())


def test_a_session_closed_while_its_stream_ends_writes_no_snapshot_after_the_close():
    async def go():
        store = MemoryStore()
        d = Drafter(CFG, store, snapshot_every=1)
        entry, _ = await d.open(Open("t", "s", _history(5), []))
        tree = d.step(entry, Step([], [], 0, 3, 8, "racer"))
        d.after_response(entry)  # a snapshot on its way when the close comes
        assert await d.drop("t", "s")
        n = len(tree.tokens)
        d.step(entry, Step([0] * (n * CFG.topk), [0], 1, 4, 8, "racer"))  # the stream's last round
        d.after_response(entry)
        d.end_turn(entry)
        d.release(entry)
        await d.flush()
        assert await store.get(snapshot_key("t", "s")) is None, "the closed session's snapshot came back"
        assert ("t", "s") not in d.sessions

    asyncio.run(go())


def test_the_tenant_corpus_counts_in_the_memory_bound_and_its_metric():
    async def go():
        free = Drafter(CFG, MemoryStore())
        await _turn(free, "s0", _history(0))
        one = free.sessions.get(("t", "s0")).session.memory_estimate()
        store = MemoryStore()
        corpora = Corpora(1 << 16, store=store)
        d = Drafter(CFG, store, max_bytes=1, corpora=corpora)
        await corpora.open("t", share=False)
        await corpora.tenants["t"].loading
        corpora.current("t").add(_history(99, 20_000))  # a corpus of several sessions' size
        held = corpora.nbytes()
        assert held > 2 * one
        d.max_bytes = held + int(2.5 * one)  # room for the corpus and two sessions, not four
        evicted = M.EVICTIONS._value.get()
        for i in range(4):
            await _turn(d, f"s{i}", _history(i))
        assert {e.session_id for e in d.sessions} == {"s2", "s3"}, "the corpus left room for two sessions"
        assert M.EVICTIONS._value.get() - evicted == 2
        assert d.memory_bytes() == sum(e.bytes for e in d.sessions) + held <= d.max_bytes
        assert M.CORPUS_BYTES._value.get() == held
        assert M.DRAFTER_BYTES._value.get() == sum(e.bytes for e in d.sessions)

    asyncio.run(go())
