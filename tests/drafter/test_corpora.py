"""Tenant corpora in the drafter core over the in-memory store: what comes back from the store is
checked, and bad bounds are refused."""

from __future__ import annotations

import asyncio
import os

import pytest

from common.errors import Abort, Status
from common.store import MemoryStore, RedisStore
from drafter.core import Drafter, Open, Step
from drafter.corpora import Corpora, CorpusRecordError, Response, decode, encode, stream_key
from drafter.draft_session import DrafterConfig


def test_records_round_trip_and_malformed_ones_are_refused():
    data = encode(3, 7, 9, [1, 2, 3])
    epoch, replica, number, tokens = decode(data)
    assert (epoch, replica, number, tokens.tolist()) == (3, 7, 9, [1, 2, 3])
    for bad in (b"", b"XX1" + data[3:], data[:-1], data + b"\0\0\0\0", encode(0, 0, 0, [1 << 20])):
        with pytest.raises(CorpusRecordError):
            decode(bad)


def test_a_corrupted_record_in_the_stream_is_skipped_and_the_rest_indexed():
    async def go():
        store = MemoryStore()
        await store.xadd(stream_key("t"), encode(0, 1, 1, [5, 6, 7, 8]), 100, 60.0)
        await store.xadd(stream_key("t"), b"RC1 not a record", 100, 60.0)
        await store.xadd(stream_key("t"), encode(0, 1, 1, [9, 10]), 100, 60.0)  # same response: continues it
        corpora = Corpora(1000, store=store)
        await corpora.open("t", share=False)
        await corpora.tenants["t"].loading
        c = corpora.current("t")
        assert len(c) == 6 and c.continuation(c.match([6, 7], 8)[1][0], 5) == [9, 10]

    asyncio.run(go())


def test_an_absurd_corpus_bound_is_refused():
    async def go():
        d = Drafter(DrafterConfig(), MemoryStore(), corpora=Corpora(1000, store=MemoryStore()))
        for bad in (-1, 1 << 40):
            with pytest.raises(Abort) as e:
                await d.open(Open("t", "s", [1, 2, 3], [], corpus_tokens=bad))
            assert e.value.code == Status.INVALID_ARGUMENT and "corpus_tokens" in e.value.message

    asyncio.run(go())


async def _stream_tokens(store, tenant: str) -> list[int]:
    """Every token the tenant's stream holds, in order."""
    out, last = [], "0"
    while got := (await store.xread({stream_key(tenant): last}, 100)).get(stream_key(tenant)):
        out += [t for _, data in got for t in decode(data)[3].tolist()]
        last = got[-1][0]
    return out


@pytest.mark.parametrize("chunk", [1, 7])
def test_the_stream_is_bounded_in_tokens_like_the_corpus(chunk):
    """One chunk per sync: the stream keeps the corpus's live tokens (and at most one chunk more),
    whether a chunk holds one token or many, and a replica loading it gets the same corpus."""

    async def go():
        store = MemoryStore()
        corpora = Corpora(100, store=store)
        resp = await corpora.open("t")
        await corpora.tenants["t"].loading
        written = []
        for i in range(400 // chunk):
            tokens = [(i * chunk + j) % 997 for j in range(chunk)]
            corpora.append(resp, tokens)
            written += tokens
            await corpora.sync()
        held = await _stream_tokens(store, "t")
        assert 100 <= len(held) <= 100 + chunk and held == written[-len(held) :]
        fresh = Corpora(100, store=store)
        await fresh.open("t", share=False)
        await fresh.tenants["t"].loading
        c, f = corpora.current("t"), fresh.current("t")
        assert len(c) == len(f) == 100
        assert f.continuation(f.match(written[-60:-52], written[-52])[1][0], 51) == written[-51:]

    asyncio.run(go())


def test_the_stream_expires_after_its_last_write_and_each_write_sets_it_again():
    async def go():
        store = MemoryStore()
        corpora = Corpora(100, store=store, stream_ttl=1000.0)
        resp = await corpora.open("t")
        await corpora.tenants["t"].loading
        corpora.append(resp, [1, 2, 3])
        await corpora.sync()
        assert 900_000 < await store.pttl(stream_key("t")) <= 1_000_000
        corpora.stream_ttl = 5000.0
        corpora.append(resp, [4, 5])
        await corpora.sync()
        assert 4_900_000 < await store.pttl(stream_key("t")) <= 5_000_000

    asyncio.run(go())


def test_redis_streams_carry_their_ttl_and_trim_by_id(redis_url):
    async def go():
        store = RedisStore(redis_url)
        key = stream_key(f"ttl-and-trim-{os.urandom(4).hex()}")  # the Redis is shared with other tests
        try:
            ids = [await store.xadd(key, encode(0, 1, 1, [i]), 100, 30.0) for i in range(5)]
            assert 29_000 < await store.pttl(key) <= 30_000
            await store.xadd(key, encode(0, 1, 1, [5]), 100, 600.0)
            assert 590_000 < await store.pttl(key) <= 600_000, "a write sets the stream's TTL again"
            assert await store.xtrim(key, ids[3]) == 3
            assert [decode(d)[3].tolist() for _, d in (await store.xread({key: "0"}, 10))[key]] == [[3], [4], [5]]
        finally:
            await store.xdelete(key)
            await store.close()

    asyncio.run(go())


def _answer(d: Drafter, tenant: str, sid: str, prompt: list[int], response: list[int], end: list[int] | None):
    """A turn as the gateway runs it: a step per round, each accepting only its root (so round i
    commits the response's token i - 1), and the last round's tokens, ``response[-3:]``, left to
    ``end_turn`` (``end``: its tokens; None: the whole response)."""

    async def go():
        entry, _ = await d.open(Open(tenant, sid, prompt, []))
        n = 0
        for i, root in enumerate(response[:-2]):
            fb = ([0] * (n * d.config.topk), [0], 1) if i else ([], [], 0)
            n = len(d.step(entry, Step(*fb, root, 8, "racer")))
        try:
            d.end_turn(entry, response if end is None else end)
        finally:
            d.release(entry)

    return go()


def test_a_finished_response_is_in_the_corpus_whole_on_every_replica_and_before_the_next_session():
    """The last round's tokens are committed by no step: ``end_turn`` brings them. They are in the
    replica's corpus when the tenant's next session opens there, and on another replica at its
    next sync."""

    async def go():
        store = MemoryStore()
        d = Drafter(DrafterConfig(), store, corpora=Corpora(1000, store=store))
        other = Corpora(1000, store=store)
        await other.open("t", share=False)
        await d.corpora.open("t", share=False)
        await asyncio.gather(d.corpora.tenants["t"].loading, other.tenants["t"].loading)
        response = [(7 * i + 3) % 500 for i in range(40)]
        await _answer(d, "t", "s1", [1, 2, 3, 4], response, None)
        await d.open(Open("t", "s2", [9, 8, 7], []))  # the next session: its open syncs the tenant
        c = d.corpora.current("t")
        assert c.tok[: c.total].tolist() == response
        await other.sync()
        c = other.current("t")
        assert c.tok[: c.total].tolist() == response
        assert await _stream_tokens(store, "t") == response

    asyncio.run(go())


def test_end_turn_tokens_that_disagree_with_what_the_steps_committed_are_refused():
    async def go():
        d = await _drafter_with_loaded_corpus()
        response = list(range(10, 30))
        for bad in ([5] + response[1:], response[:3], response[:-1] + [-1]):
            with pytest.raises(Abort) as e:
                await _answer(d, "t", f"s{len(bad)}-{bad[0]}", [1, 2, 3], response, bad)
            assert e.value.code == Status.INVALID_ARGUMENT and "end_turn.tokens" in e.value.message
        await _answer(d, "t", "no-tail", [1, 2, 3], response, [])  # an older gateway's EndTurn: no tail
        await d.corpora.sync()
        assert len(d.corpora.current("t")) == 4 * 17  # what the steps of the 4 turns committed, no tail

    asyncio.run(go())


def test_every_token_that_enters_a_response_is_checked_against_the_corpus_id_range():
    """A step's committed tokens and the end of a turn go through ``Corpora.append``: an id the
    corpus cannot hold is refused there, before the session learns from it or a record carries it."""
    from drafter.corpus import TOKEN_LIMIT

    corpora = Corpora(1000, store=MemoryStore())
    resp = Response("t", 1, 0)
    for bad in ([1, TOKEN_LIMIT], [-1], [TOKEN_LIMIT + 5, 2]):
        with pytest.raises(ValueError):
            corpora.append(resp, bad)
    assert resp.pending == []
    corpora.append(resp, [0, TOKEN_LIMIT - 1])
    assert resp.pending == [0, TOKEN_LIMIT - 1]

    async def go():
        store = MemoryStore()
        d = Drafter(DrafterConfig(), store, corpora=Corpora(1000, store=store))
        entry, _ = await d.open(Open("t", "s", [1, 2, 3], []))
        d.step(entry, Step([], [], 0, TOKEN_LIMIT, 8, "racer"))  # drafted from; committed at the next step
        k = d.config.topk
        with pytest.raises(Abort) as e:
            d.step(entry, Step([0] * (len(entry.tree) * k), [0], 1, 5, 8, "racer"))
        assert e.value.code == Status.INVALID_ARGUMENT and "step" in e.value.message
        assert entry.session.history == [1, 2, 3], "a refused step left the session as it was"
        with pytest.raises(Abort) as e:
            d.end_turn(entry, [TOKEN_LIMIT])
        assert e.value.code == Status.INVALID_ARGUMENT and "end_turn.tokens" in e.value.message
        d.release(entry)

    asyncio.run(go())


def test_the_last_rounds_accepted_corpus_nodes_are_counted_at_the_end_of_the_turn():
    """No step feeds the last tree back; the end of the turn's tokens spell its accepted path."""
    from prometheus_client import REGISTRY

    def metric():
        return REGISTRY.get_sample_value("racer_draft_accepted_total", {"source": "corpus"}) or 0.0

    async def go():
        d = await _drafter_with_loaded_corpus()
        answer = list(range(100, 140))
        d.corpora.current("t").add([1, 2, 3, 4, 5] + answer)
        entry, _ = await d.open(Open("t", "s", [1, 2, 3, 4, 5, 100, 101], []))
        tree = d.step(entry, Step([], [], 0, 102, 8, "racer"))
        assert [tree.tokens[i] for i in tree.corpus_nodes][:3] == [103, 104, 105]
        before = metric()
        # the last round: 103, 104, 105 accepted, then the target's own 7 (no node of the tree)
        d.end_turn(entry, [102, 103, 104, 105, 7])
        assert entry.session.accepted["corpus"] == 3 and metric() - before == 3
        d.end_turn(entry, [102, 103, 104, 105, 7])  # the same tree is counted once
        assert entry.session.accepted["corpus"] == 3 and metric() - before == 3
        d.release(entry)

    asyncio.run(go())


async def _drafter_with_loaded_corpus() -> Drafter:
    """A drafter over a memory store whose tenant "t" corpus is loaded (empty)."""
    store = MemoryStore()
    d = Drafter(DrafterConfig(), store, corpora=Corpora(1000, store=store))
    await d.corpora.open("t", share=False)
    await d.corpora.tenants["t"].loading
    return d
