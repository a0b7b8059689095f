"""A restored snapshot is the same drafter: same drafts now and after more tokens, same evictions."""

import random
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.params import MODES
from drafter.draft_session import DrafterConfig, DraftSession
from drafter.snapshot import SnapshotError, dumps, loads, snapshot_length
from tests.support import snapshots as snaps

CFG = DrafterConfig(window=4, max_nodes=4 * 5 + 1 + 9, topk=3)


def _fill(s: DraftSession, rng: random.Random, n: int, vocab: int) -> None:
    for _ in range(n):
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        rows = [[rng.randrange(vocab) for _ in range(3)] for _ in toks]
        s.extend(toks, rows if rng.random() < 0.7 else None)


def _drafts(s: DraftSession, vocab: int) -> list:
    return [(t.tokens, t.parents) for m in MODES for root in range(vocab) for t in [s.draft(root, 12, m)]]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(0, 40), more=st.integers(1, 20))
def test_restored_session_drafts_and_evolves_like_the_original(seed, steps, more):
    rng = random.Random(seed)
    vocab = 6
    a = DraftSession(CFG, prior=np.arange(vocab * 3).reshape(vocab, 3) % vocab)
    _fill(a, rng, steps, vocab)
    b = loads(dumps(a), CFG, prior=a.table.prior)
    assert _drafts(b, vocab) == _drafts(a, vocab)
    # the same future on both: evictions, failure links, LRU order and prompt lookup must agree
    r1, r2 = random.Random(seed + 1), random.Random(seed + 1)
    _fill(a, r1, more, vocab)
    _fill(b, r2, more, vocab)
    assert _drafts(b, vocab) == _drafts(a, vocab)
    assert b.automaton.to_state() == a.automaton.to_state()


def test_full_capacity_session_round_trips():
    rng = random.Random(0)
    cfg = DrafterConfig()
    a = DraftSession(cfg)
    a.extend([rng.randrange(2000) for _ in range(3000)], [[rng.randrange(2000) for _ in range(8)] for _ in range(3000)])
    assert len(a.automaton.parent) == cfg.max_nodes
    data = dumps(a)
    assert snapshot_length(data) == 3000
    b = loads(data, cfg)
    assert b.automaton.to_state() == a.automaton.to_state()
    assert b.table.rows == a.table.rows and b.history == a.history


def test_mismatched_config_and_garbage_are_refused():
    a = DraftSession(CFG)
    a.extend([1, 2, 3])
    with pytest.raises(SnapshotError, match="window"):
        loads(dumps(a), DrafterConfig())
    with pytest.raises(SnapshotError):
        loads(b"not a snapshot", CFG)
    with pytest.raises(SnapshotError):
        loads(dumps(a)[:-40], CFG)


# -- untrusted bytes: every structural check refuses, in bounded time --------------------------------


def _valid() -> bytes:
    """A session below capacity, plus one freed id (an evicted node whose id is not reused yet)."""
    a = DraftSession(CFG)
    a.extend([1, 2, 3, 1, 2, 4, 5, 1], [[t, 2, 3] for t in range(8)])
    z = snaps.unpack(dumps(a))
    n = int(z["meta"][5])
    assert n < CFG.max_nodes and z["bucket_starts"].size > 2
    for k, v in (("parent", -1), ("token", 9), ("freq", 0), ("fail", 0), ("start", -1)):
        z[k] = np.append(z[k], v)
    z["child_ptr"] = np.append(z["child_ptr"], z["child_ptr"][-1])
    z["free"] = np.array([n], dtype=np.int64)
    z["meta"][5] = n + 1
    return snaps.pack(z)


def _mutate(fn):
    def apply(data: bytes) -> bytes:
        z = snaps.unpack(data)
        fn(z)
        return snaps.pack(z)

    return apply


def _edit_kids(fn):
    def apply(z):
        groups = snaps.kids(z)
        fn(z, groups)
        snaps.set_kids(z, groups)

    return apply


def _first_child(z) -> int:
    return snaps.kids(z)[0][0]


def _grandchild(z) -> tuple[int, int]:
    groups = snaps.kids(z)
    return next((v, groups[v][0]) for v in groups[0] if groups[v])


def _set(name, index, value):
    def apply(z):
        z[name][index] = value

    return apply


BAD = {
    "self-cycle": _edit_kids(lambda z, g: g[g[0][0]].append(g[0][0])),
    "cycle back to the root's child": _edit_kids(lambda z, g: g[_grandchild(z)[1]].append(_grandchild(z)[0])),
    "node listed under two parents": _edit_kids(lambda z, g: g[_grandchild(z)[0]].append(g[0][-1])),
    "root listed as a child": _edit_kids(lambda z, g: g[g[0][0]].append(0)),
    "child id out of range": _edit_kids(lambda z, g: g[0].append(len(g) + 5)),
    "negative child id": _edit_kids(lambda z, g: g[0].append(-3)),
    "free node listed as a child": _edit_kids(lambda z, g: g[0].append(int(z["free"][0]))),
    "unreachable live node": _edit_kids(lambda z, g: g[0].pop()),
    "parent disagrees": lambda z: z["parent"].__setitem__(_grandchild(z)[1], 0),
    "negative token": lambda z: z["token"].__setitem__(_first_child(z), -4),
    "negative frequency": lambda z: z["freq"].__setitem__(_first_child(z), -1),
    "failure link elsewhere": lambda z: z["fail"].__setitem__(_grandchild(z)[1], _grandchild(z)[1]),
    "start past the history": lambda z: z["start"].__setitem__(_first_child(z), 10**9),
    "free id out of range": _set("free", 0, 10**6),
    "live node in the free list": lambda z: z.__setitem__("free", np.append(z["free"], _first_child(z))),
    "free list repeats": lambda z: z.__setitem__("free", np.append(z["free"], z["free"][0])),
    "child pointers decrease": _set("child_ptr", 1, -1),
    "child pointers overrun": lambda z: z["child_ptr"].__setitem__(-1, z["child_ptr"][-1] + 1),
    "buckets out of order": lambda z: z.__setitem__("bucket_starts", z["bucket_starts"][::-1].copy()),
    "bucket member of another start": lambda z: z.__setitem__(
        "bucket_nodes", np.roll(z["bucket_nodes"], 1)
    ),  # members shift into the neighbouring buckets
    "bucket member out of range": _set("bucket_nodes", 0, 10**6),
    "frontier id out of range": _set("frontier", -1, 10**6),
    "frontier too long": lambda z: z.__setitem__("frontier", np.append(z["frontier"], z["frontier"][-1])),
    "automaton length differs": _set("a_length", 0, 3),
    "table rows of the wrong width": lambda z: z.__setitem__("table_rows", z["table_rows"][:, :2].copy()),
    "table rows and tokens differ": lambda z: z.__setitem__("table_tokens", z["table_tokens"][:-1].copy()),
    "negative table token": _set("table_tokens", 0, -2),
    "repeated table token": lambda z: z["table_tokens"].__setitem__(1, z["table_tokens"][0]),
    "negative history token": _set("history", 0, -1),
    "history longer than its version": lambda z: z.__setitem__("history", np.append(z["history"], 1)),
    "last top-k too wide": lambda z: z.__setitem__("last_topk", np.arange(5, dtype=np.int64)),
    "float node array": lambda z: z.__setitem__("parent", z["parent"].astype(np.float64)),
    "int32 node array": lambda z: z.__setitem__("token", z["token"].astype(np.int32)),
    "2-d node array": lambda z: z.__setitem__("freq", z["freq"].reshape(1, -1)),
    "node arrays' sizes differ": lambda z: z.__setitem__("token", z["token"][:-1].copy()),
    "more nodes than the capacity": _set("meta", 5, CFG.max_nodes + 1),
    "format version": _set("meta", 0, 2),
    "missing member": lambda z: z.pop("free"),
    "extra member": lambda z: z.__setitem__("extra", np.zeros(1, dtype=np.int64)),
}


@pytest.mark.timeout(20)  # a walk without a cycle check never returns
@pytest.mark.parametrize("case", BAD)
def test_each_structural_check_refuses_a_mutated_snapshot(case):
    data = _valid()
    loads(data, CFG)  # the unmutated snapshot is fine
    with pytest.raises(SnapshotError):
        loads(_mutate(BAD[case])(data), CFG)


def test_history_past_the_drafters_bound_is_refused():
    data = _valid()
    n = snapshot_length(data)
    loads(data, CFG, max_tokens=n)
    with pytest.raises(SnapshotError, match="at most"):
        loads(data, CFG, max_tokens=n - 1)


def test_a_zip_bomb_is_refused_unread():
    data = _valid()
    bomb = snaps.zip_bomb(data)
    assert len(bomb) < 1 << 20  # 64 MiB inflated
    # Unread: the memory Python allocated while refusing it (inflated bytes and arrays included)
    # stays far below what inflating it would take, whatever the machine's speed.
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError, match="history"):
            loads(bomb, CFG)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated: the bomb was inflated"


def test_a_member_that_inflates_past_its_declared_size_is_refused():
    data = _valid()
    bomb = bytearray(snaps.zip_bomb(data, inflated=4 << 20))
    # declare the history small in the central directory: zipfile stops there and the CRC fails
    cd = bomb.rindex(b"PK\x01\x02")  # the last central directory entry: history, written last
    assert bomb[cd + 46 : cd + 46 + 11] == b"history.npy"
    bomb[cd + 24 : cd + 28] = (100).to_bytes(4, "little")
    with pytest.raises(SnapshotError):
        loads(bytes(bomb), CFG)


def test_a_pickled_member_is_refused():
    z = snaps.unpack(_valid())
    z["history"] = np.array([object()], dtype=object)
    with pytest.raises(SnapshotError):
        loads(snaps.pack(z), CFG)
