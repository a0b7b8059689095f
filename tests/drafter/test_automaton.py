"""Property tests for drafter.automaton.Automaton against brute force on the token list.

Two regimes: an unbounded one (max_nodes far above the number of distinct substrings, so nothing is
evicted and the trie must hold *exactly* the substrings), and an evicting one (small alphabets,
window 2..5, max_nodes from the minimum window*(window+1)+1 up to ~80, contexts long enough to fill
it many times over).

Regression inputs: MIN_REPRO and CRASH_REPRO once made ``append`` evict a node it had just
reached for the current token; SNAPSHOT_REPRO once made a restored snapshot draft differently
(children order lost with recycled ids). They are pinned as explicit examples.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from drafter.automaton import ROOT, Automaton
from drafter.tree import _Trie, add_retrieval

from .refs import check_automaton, freq_map, live_nodes, safe_string, substring_counts, suffix, trie_strings

# append() once evicted (0,) here while reaching it for (1,0): the trie lost the suffix of a live node.
MIN_REPRO = dict(window=2, max_nodes=7, tokens=[0, 2, 3, 1, 0])
# The same fault a few tokens later made append() evict a node with children.
CRASH_REPRO = dict(window=2, max_nodes=8, tokens=[0, 3, 1, 2, 1, 0, 0, 2, 0, 0])


def _case(r):
    return (r["window"], r["max_nodes"], list(r["tokens"]))


# from_state() once rebuilt children in node-id order; with recycled ids the drafts then differed.
SNAPSHOT_REPRO = dict(window=3, max_nodes=13, tokens=[1, 1, 0, 0, 1, 0, 2])

FAST = settings(max_examples=150, deadline=None)
EVICT = settings(max_examples=100, deadline=None)

tokens_st = st.lists(st.integers(0, 5), min_size=0, max_size=60)


@st.composite
def evicting(draw, max_len=90):
    """(window, max_nodes, tokens) with a capacity small enough that eviction really happens."""
    window = draw(st.integers(2, 5))
    lo = window * (window + 1) + 1
    max_nodes = draw(st.one_of(st.just(lo), st.integers(lo, lo + 8), st.integers(lo, max(lo, 80))))
    alpha = draw(st.integers(2, 6))
    # long enough to overflow the capacity most of the time (shrinking still shortens failures)
    tokens = draw(st.lists(st.integers(0, alpha - 1), min_size=min(max_len, 3 * max_nodes // window), max_size=max_len))
    return window, max_nodes, tokens


@st.composite
def unbounded(draw, max_len=60):
    window = draw(st.integers(1, 5))
    alpha = draw(st.integers(1, 6))
    tokens = draw(st.lists(st.integers(0, alpha - 1), min_size=0, max_size=max_len))
    return window, 10**9, tokens


class Spy(Automaton):
    """Records every eviction (victim, its string, whether it had children, its LRU key and the
    minimum key at that moment) and flags a victim that the current append walks to (an existing
    ``s + c`` for a suffix ``s`` on the frontier)."""

    __slots__ = ("evictions", "path", "reached_node_evicted")

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.evictions = []
        self.path = set()
        self.reached_node_evicted = False

    def append(self, c):
        if not self.reached_node_evicted:
            self.path = {self.children[u].get(c) for u in self.frontier} - {None}
        super().append(c)

    def _evict_one(self):
        if self.reached_node_evicted:  # state already corrupted: do not inspect it
            return super()._evict_one()
        free_before = set(self._free)
        live = [v for v in range(1, len(self.children)) if v not in free_before]
        had_children = {v: bool(self.children[v]) for v in live}
        # LRU key of every touched live node: later start is newer, then shorter is newer.
        keys = {v: (self.start[v], -self.depth[v]) for v in live if self.start[v] >= 0}
        strings = {v: safe_string(self, v) for v in live}
        super()._evict_one()
        victim = self._free[-1]
        self.evictions.append((victim, strings[victim], had_children[victim], keys.get(victim), min(keys.values())))
        if victim in self.path:
            self.reached_node_evicted = True


def run_checked(window, max_nodes, tokens, cls=Automaton):
    a = cls(window, max_nodes)
    ctx = []
    check_automaton(a, ctx)
    for t in tokens:
        a.append(t)
        ctx.append(t)
        check_automaton(a, ctx)
    return a, ctx


# -- invariants after every append ----------------------------------------------------------------
@FAST
@given(unbounded())
def test_invariants_without_eviction(case):
    run_checked(*case)


@FAST
@given(evicting())
@example(_case(MIN_REPRO))
@example(_case(CRASH_REPRO))
def test_invariants_with_eviction(case):
    """Capacity, prefix/suffix closure, exact fail links, frontier and match state after every token."""
    run_checked(*case)


def test_regression_state_before_the_eviction_repro():
    """The state MIN_REPRO's last token starts from: (0,) is an old leaf, the LRU node."""
    a = Automaton(2, 7)
    a.extend([0, 2, 3, 1])
    assert trie_strings(a).keys() == {(0,), (1,), (2,), (2, 3), (3,), (3, 1)}
    assert a.find((0,)) > 0 and not a.children[a.find((0,))]  # (0,) is an old leaf: the LRU node


def test_regression_reached_node_is_not_evicted():
    a = Automaton(MIN_REPRO["window"], MIN_REPRO["max_nodes"])
    a.extend(MIN_REPRO["tokens"])
    assert a.find((0,)) != -1, "suffix (0,) of the live node (1,0) was evicted"
    assert a.fail[a.find((1, 0))] == a.find((0,))
    assert [a.string(v) for v in a.frontier] == [(), (0,), (1, 0)]


def test_regression_no_victim_with_children():
    a = Automaton(CRASH_REPRO["window"], CRASH_REPRO["max_nodes"])
    a.extend(CRASH_REPRO["tokens"])  # once raised: LRU victim has children
    check_automaton(a, list(CRASH_REPRO["tokens"]))


# -- exact content without eviction ---------------------------------------------------------------
@FAST
@given(unbounded())
def test_exact_substrings_and_frequencies_without_eviction(case):
    window, max_nodes, tokens = case
    a = Automaton(window, max_nodes)
    ctx = []
    for t in tokens:
        a.append(t)
        ctx.append(t)
        subs = substring_counts(ctx, window)
        assert freq_map(a) == dict(subs)
        assert len(a) == len(subs) + 1  # root included
        for s in subs:
            assert a.find(s) > 0 and a.string(a.find(s)) == s
        # match state: the whole last-`window` suffix is always present without eviction
        assert a.string(a.state) == suffix(ctx, min(len(ctx), window))
    assert a._free == []


@FAST
@given(st.integers(1, 5), tokens_st, st.lists(st.integers(0, 6), max_size=6))
def test_find_agrees_with_substrings(window, tokens, probe):
    a = Automaton(window, 10**9)
    a.extend(tokens)
    subs = substring_counts(tokens, window)
    node = a.find(probe)
    if not probe:
        assert node == ROOT
    elif tuple(probe) in subs:
        assert node > 0 and a.string(node) == tuple(probe)
    else:
        assert node == -1


# -- eviction ---------------------------------------------------------------------------------------
@FAST
@given(evicting())
@example(_case(CRASH_REPRO))
def test_capacity_never_exceeded(case):
    window, max_nodes, tokens = case
    a = Automaton(window, max_nodes)
    for t in tokens:
        a.append(t)
        assert len(a) <= max_nodes
        assert len(a) == len(live_nodes(a))


@FAST
@given(evicting(max_len=200))
@example(_case(MIN_REPRO))
@example(_case(CRASH_REPRO))
def test_eviction_is_lru_of_leaves(case):
    """Every victim is a leaf at eviction time and holds the minimum LRU key (start, -length)."""
    window, max_nodes, tokens = case
    a = Spy(window, max_nodes)
    a.extend(tokens)
    assert not a.reached_node_evicted, "evicted a node the current append had just reached"
    distinct = len(substring_counts(tokens, window))
    if distinct + 1 > max_nodes:
        assert a.evictions, "capacity exceeded by distinct substrings but nothing was evicted"
    for _victim, s, had_children, key, min_key in a.evictions:
        assert not had_children, f"evicted {s} while it had children"
        assert key is not None, f"evicted {s}, a node created in this very append (never touched)"
        assert key == min_key, f"evicted {s} with key {key}, but the LRU key is {min_key}"


@FAST
@given(evicting())
@example(_case(MIN_REPRO))
@example(_case(CRASH_REPRO))
def test_evicted_nodes_had_no_children_and_survivors_keep_identity(case):
    """Across each append: a node live before that disappears (freed, or its id recycled for another
    string) had no children before, unless those children disappeared in the same append too; and no
    node whose string is needed by the current step (a suffix of the context of length <= window)
    is gone afterwards."""
    window, max_nodes, tokens = case
    a = Automaton(window, max_nodes)
    ctx = []
    for t in tokens:
        before = {v: (safe_string(a, v), dict(a.children[v])) for v in live_nodes(a) if v != ROOT}
        a.append(t)
        ctx.append(t)
        after = trie_strings(a)
        gone = {v for v, (s, _) in before.items() if after.get(s) != v}
        for v in gone:
            s, kids = before[v]
            assert all(ch in gone for ch in kids.values()), f"evicted {s} leaving live children (orphans)"
        for L in range(1, min(len(ctx), window) + 1):
            assert suffix(ctx, L) in after, f"suffix {suffix(ctx, L)} of the context missing after append"


# -- snapshots ----------------------------------------------------------------------------------------
def _draft(a: Automaton, root: int, budget: int, min_depth: int):
    trie = _Trie(root, budget)
    n = add_retrieval(trie, a, root, min_depth)
    return trie.flatten(n)


def _roundtrip_check(window, max_nodes, before, after, via_json):
    a = Automaton(window, max_nodes)
    ctx = []
    for t in before:
        a.append(t)
        ctx.append(t)
        check_automaton(a, ctx)  # bounded checks first: never snapshot a corrupted automaton
    st_ = a.to_state()
    if via_json:
        st_ = json.loads(json.dumps(st_))
    b = Automaton.from_state(st_)
    check_automaton(b, ctx)
    for t in [None, *after]:
        if t is not None:
            a.append(t)
            b.append(t)
            ctx.append(t)
            check_automaton(a, ctx)
            check_automaton(b, ctx)
        assert freq_map(a) == freq_map(b)
        assert a.state == b.state and a.frontier == b.frontier
        assert a.to_state() == b.to_state()
        for root in range(6):
            for budget in (2, 5, 16):
                assert _draft(a, root, budget, 1) == _draft(b, root, budget, 1), (root, budget)
                assert _draft(a, root, budget, 2) == _draft(b, root, budget, 2), (root, budget)


@FAST
@given(unbounded(max_len=40), st.lists(st.integers(0, 5), max_size=15), st.booleans())
def test_snapshot_roundtrip_without_eviction(case, after, via_json):
    window, max_nodes, before = case
    _roundtrip_check(window, max_nodes, before, after, via_json)


@FAST
@given(evicting(max_len=120), st.lists(st.integers(0, 5), max_size=15), st.booleans())
@example(_case(SNAPSHOT_REPRO), [], False)
@example(_case(MIN_REPRO), [], False)
def test_snapshot_roundtrip_with_eviction(case, after, via_json):
    window, max_nodes, before = case
    _roundtrip_check(window, max_nodes, before, after, via_json)


def test_snapshot_repro_is_a_valid_automaton():
    """Every invariant holds throughout the snapshot repro, and node ids were recycled."""
    a, _ = run_checked(**SNAPSHOT_REPRO)
    assert a._free == [] and len(a) == SNAPSHOT_REPRO["max_nodes"]  # ids were recycled


def test_regression_snapshot_keeps_child_order():
    a, _ = run_checked(**SNAPSHOT_REPRO)
    b = Automaton.from_state(a.to_state())
    assert a.to_state() == b.to_state()  # the persisted fields agree ...
    assert _draft(a, 1, 4, 1) == _draft(b, 1, 4, 1)  # ... and so do the drafts


# -- constructor ------------------------------------------------------------------------------------
@given(st.integers(-5, 0), st.integers(0, 10**6))
def test_constructor_rejects_bad_window(window, max_nodes):
    with pytest.raises(ValueError):
        Automaton(window, max_nodes)


@given(st.integers(1, 12), st.data())
def test_constructor_capacity_bound(window, data):
    lo = window * (window + 1) + 1
    bad = data.draw(st.integers(-3, lo - 1))
    with pytest.raises(ValueError):
        Automaton(window, bad)
    a = Automaton(window, data.draw(st.integers(lo, lo + 100)))
    assert len(a) == 1 and a.state == ROOT and a.frontier == [ROOT]
