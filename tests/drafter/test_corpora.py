"""Tenant corpora in the drafter core over the in-memory store: what comes back from the store is
checked, and bad bounds are refused."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import Abort, Status
from common.store import MemoryStore
from drafter.core import Drafter, Open
from drafter.corpora import Corpora, CorpusRecordError, decode, encode, stream_key
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
        await store.xadd(stream_key("t"), encode(0, 1, 1, [5, 6, 7, 8]), 100)
        await store.xadd(stream_key("t"), b"RC1 not a record", 100)
        await store.xadd(stream_key("t"), encode(0, 1, 1, [9, 10]), 100)  # same response: continues it
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
