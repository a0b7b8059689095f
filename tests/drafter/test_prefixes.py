"""Shared prompt prefixes: a tenant's sessions that begin alike reference one drafting state of that
start instead of copying it; their snapshots name it; restores rebuild or find it and draft as before."""

from __future__ import annotations

import asyncio
import io
import random
import uuid

import numpy as np
import pytest

from common.store import MemoryStore, RedisStore
from drafter.core import Drafter, Open, Step, snapshot_key
from drafter.draft_session import DrafterConfig, DraftSession
from drafter.prefixes import BLOCK, SharedPrefixes, build
from drafter.snapshot import SnapshotError, loads

CFG = DrafterConfig(window=4, max_nodes=400, topk=3)
VOCAB = 40
_RNG = random.Random(7)
SYSTEM = [_RNG.randrange(VOCAB) for _ in range(5 * BLOCK + 17)]  # the tools' docs, say


def _question(seed: int, n: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _rows(tokens) -> list[int]:
    """A top-k row per position (flattened), a function of the tokens up to it, as the target's is."""
    return [(t * 7 + i + tokens[max(0, p - 1)]) % VOCAB for p, t in enumerate(tokens) for i in range(CFG.topk)]


def _drafter(store=None, min_tokens: int = 2 * BLOCK) -> Drafter:
    return Drafter(CFG, store or MemoryStore(), prefixes=SharedPrefixes(CFG.window, CFG.topk, min_tokens))


async def _open(d: Drafter, tenant: str, sid: str, history: list[int], rows=True):
    entry, source = await d.open(Open(tenant, sid, history, _rows(history) if rows else []))
    return entry, source


async def _turn(d: Drafter, tenant: str, sid: str, history: list[int], mode: str = "racer"):
    entry, source = await _open(d, tenant, sid, history)
    tree = d.step(entry, Step([], [], 0, history[-1], 24, mode))
    d.end_turn(entry)
    d.release(entry)
    await d.flush()
    return source, (list(tree.tokens), list(tree.parents)), entry.session


def _tenants(n: int = 2) -> list[str]:
    """Tenant names of their own in the shared test Redis."""
    tag = uuid.uuid4().hex[:8]
    return [f"{c}-{tag}" for c in "ab"[:n]]


def test_sessions_of_a_tenant_share_one_prefix_and_other_tenants_never_do(redis_url):
    async def go():
        a, b = _tenants()
        d = _drafter(RedisStore(redis_url))
        s0 = (await _turn(d, a, "s0", SYSTEM + _question(0)))[2]
        assert s0.prefix is None  # the first session drafts alone: nothing to share with yet
        s1 = (await _turn(d, a, "s1", SYSTEM + _question(1)))[2]
        s2 = (await _turn(d, a, "s2", SYSTEM + _question(2)))[2]
        assert s1.prefix is not None and s2.prefix is s1.prefix  # one object, referenced
        assert len(s1.prefix) == len(SYSTEM) // BLOCK * BLOCK and s1.prefix.tokens == tuple(SYSTEM[: len(s1.prefix)])
        assert d.prefixes.built == 1
        # the session's own automaton holds its own tokens (and the boundary's n-grams) only
        assert len(s2.automaton) < len(s0.automaton) / 2
        assert s2.history == SYSTEM + _question(2)
        # tenant b sends the very same prompts: it never gets a's prefix, and makes its own
        b1 = (await _turn(d, b, "s1", SYSTEM + _question(1)))[2]
        assert b1.prefix is None
        b2 = (await _turn(d, b, "s2", SYSTEM + _question(2)))[2]
        assert b2.prefix is not None and b2.prefix is not s1.prefix and b2.prefix.digest != s1.prefix.digest
        assert d.memory_bytes() >= d.prefixes.nbytes() > 0
        # restored on another replica, b's session names b's prefix, not a's
        other = _drafter(RedisStore(redis_url))
        entry, source = await other.open(Open(b, "s2", SYSTEM + _question(2), []))
        assert source == "snapshot" and entry.session.prefix.digest == b2.prefix.digest
        other.release(entry)
        await d.store.close()
        await other.store.close()

    asyncio.run(go())


def test_a_shared_session_drafts_the_prefixs_continuations():
    """What the system prompt says is drafted from the shared prefix's automaton, as from the session's
    own when nothing is shared."""
    prefix = build("a", SYSTEM[: 5 * BLOCK], CFG.window, CFG.topk)
    history = SYSTEM + _question(3) + SYSTEM[100:103]  # the session quotes the docs
    shared = DraftSession(CFG)
    shared.attach_prefix(prefix)
    shared.extend(history[len(prefix) :])
    alone = DraftSession(DrafterConfig(window=4, max_nodes=10_000, topk=3))
    alone.extend(history)
    root = SYSTEM[103]
    got = shared.draft(root, 8, "retrieval")
    assert list(got.tokens[:3]) == SYSTEM[103:106]  # the docs' continuation, from the shared automaton
    assert list(alone.draft(root, 8, "retrieval").tokens[:3]) == SYSTEM[103:106]
    # a negative control: the same session's own text without the prefix does not know it
    tail = DraftSession(CFG)
    tail.extend(history[len(prefix) :])
    assert list(tail.draft(root, 8, "retrieval").tokens[:3]) != SYSTEM[103:106]


def test_a_snapshot_names_the_prefix_instead_of_holding_it():
    async def go():
        d = _drafter()
        await _turn(d, "a", "s0", SYSTEM + _question(0))
        alone = (await _turn(d, "a", "s1-alone", SYSTEM + _question(1)))[2]  # made the prefix
        shared = (await _turn(d, "a", "s2", SYSTEM + _question(2)))[2]
        first = await d.store.get(snapshot_key("a", "s0"))
        mine = await d.store.get(snapshot_key("a", "s2"))
        assert alone.prefix is not None and shared.prefix is alone.prefix
        assert len(mine) < len(first) / 2, (len(mine), len(first))
        # what it holds is the session's own: the history after the prefix, the rows of its positions
        with np.load(io.BytesIO(mine), allow_pickle=False) as z:
            assert z["history"].tolist() == (SYSTEM + _question(2))[len(shared.prefix) :]
            assert z["prefix"][0] == len(shared.prefix)
            assert len(z["table_tokens"]) <= len(set((SYSTEM + _question(2))[len(shared.prefix) :]))
        # without a way to resolve the prefix the snapshot is refused, never restored wrong
        with pytest.raises(SnapshotError, match="shared prefix"):
            loads(mine, CFG)
        # format 1 (no prefix) is unchanged: it restores without one
        assert loads(first, CFG).history == SYSTEM + _question(0)

    asyncio.run(go())


@pytest.mark.parametrize("where", ["same replica", "fresh replica"])
def test_a_shared_session_restores_and_drafts_as_before(where, redis_url):
    async def go():
        (a,) = _tenants(1)
        store = RedisStore(redis_url)
        d = _drafter(store)
        for i in range(2):
            await _turn(d, a, f"s{i}", SYSTEM + _question(i))
        history = SYSTEM + _question(2)
        _, _, original = await _turn(d, a, "s2", history)
        more = history + _question(9, 12)
        await d.drop(a, "s0")
        other = d if where == "same replica" else _drafter(store)
        if where == "same replica":
            other.sessions.pop((a, "s2"))  # left memory: the next turn restores from the snapshot
        # the turn goes on: the restored session and the one kept in memory draft alike
        entry, source = await other.open(Open(a, "s2", more, []))
        assert source == "snapshot" and entry.session.prefix is not None
        assert entry.session.history == more
        if where == "same replica":
            assert entry.session.prefix is original.prefix
        original.extend(more[len(history) :])
        # a fresh replica rebuilt the prefix from the history, without its copy-logit rows: what the
        # automata draft is the same either way
        mode = "racer" if where == "same replica" else "retrieval"
        for root in (more[-1], SYSTEM[50], 3):
            got = entry.session.draft(root, 24, mode)
            want = original.draft(root, 24, mode)
            assert (got.tokens, got.parents) == (want.tokens, want.parents)
        other.release(entry)
        await store.close()

    asyncio.run(go())


def test_a_snapshot_whose_prefix_is_not_the_historys_is_not_used():
    async def go():
        store = MemoryStore()
        d = _drafter(store)
        for i in range(3):
            await _turn(d, "a", f"s{i}", SYSTEM + _question(i))
        data = await store.get(snapshot_key("a", "s2"))
        other = _drafter(store)
        forged = [t + 1 for t in SYSTEM[:BLOCK]] + SYSTEM[BLOCK:] + _question(2)
        _, source = await other.open(Open("a", "s2", forged, []))
        assert source == "new"  # the history does not begin with the named prefix: rebuilt from it
        # another tenant's store key holding it: the digest covers the tenant, so it resolves nowhere
        with pytest.raises(SnapshotError):
            loads(data, CFG, prefix=lambda n, dig: other.prefixes.resolve("b", n, dig, SYSTEM + _question(2)))

    asyncio.run(go())


def test_prefix_rows_come_from_the_earlier_prompt_when_this_open_carries_only_the_last_ones():
    """With the verifier's prefix cache, a later session's open carries top-k rows for the uncached tail
    only: the shared prefix takes the earlier prompt's rows of the same positions."""
    sp = SharedPrefixes(CFG.window, CFG.topk, 2 * BLOCK)
    first = SYSTEM + _question(0)
    flat = _rows(first)
    assert sp.for_new_session("a", first, [flat[i : i + 3] for i in range(0, len(flat), 3)]) is None
    second = SYSTEM + _question(1)
    tail_rows = [_rows(second)[i : i + 3] for i in range(3 * (len(second) - 20), 3 * len(second), 3)]
    p = sp.for_new_session("a", second, tail_rows)
    assert p is not None
    assert len(p.rows) == len(set(SYSTEM[: len(p)]))  # a row for every token of the prefix
    for tok in (SYSTEM[0], SYSTEM[10], SYSTEM[len(p) - 1]):
        last = max(i for i in range(len(p)) if SYSTEM[i] == tok)  # later positions win
        assert p.rows[tok] == tuple(flat[3 * last : 3 * last + 3])


def test_sharing_off_and_short_prompts_share_nothing():
    async def go():
        off = _drafter(min_tokens=0)
        for i in range(3):
            assert (await _turn(off, "a", f"s{i}", SYSTEM + _question(i)))[2].prefix is None
        d = _drafter(min_tokens=8 * BLOCK)  # longer than the common start
        for i in range(3):
            assert (await _turn(d, "a", f"s{i}", SYSTEM + _question(i)))[2].prefix is None
        assert not len(d.prefixes)

    asyncio.run(go())
