"""Property tests for drafter.tree: the draft trie, retrieval borders/expansion and logits expansion.

References are computed on the token list (occurrence counts of substrings), never from the
automaton, and the automaton is unbounded here (the eviction bug is covered in test_automaton.py).
"""

from __future__ import annotations

from collections import deque
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.automaton import Automaton
from drafter.tree import _Trie, add_logits, add_retrieval, retrieval_borders

from .refs import (
    check_tree_shape,
    retrieval_paths_reference,
    substring_counts,
    suffix,
    tree_children,
    tree_paths,
)

FAST = settings(max_examples=150, deadline=None)
BIG = 10**9

ctx_st = st.lists(st.integers(0, 5), max_size=50)
small_ctx_st = st.lists(st.integers(0, 2), max_size=50)  # repetitive: many borders and ties


# -- _Trie / flatten ---------------------------------------------------------------------------------
@FAST
@given(st.integers(0, 5), st.integers(1, 70), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3)), max_size=120))
def test_trie_add_is_unique_bounded_and_flattens_breadth_first(root, budget, ops):
    """Random adds (parent picked among existing nodes) against a set-of-paths model."""
    trie = _Trie(root, budget)
    paths = [()]  # node id -> path after the root
    model = {(): 0}
    for pick, tok in ops:
        parent = pick % len(paths)
        path = paths[parent] + (tok,)
        node = trie.add(parent, tok)
        if path in model:
            assert node == model[path], "existing (parent, token) not shared"
        elif len(paths) >= budget:
            assert node == -1, "added past the budget"
            assert trie.full()
        else:
            assert node == len(paths)
            model[path] = node
            paths.append(path)
        assert trie.child(parent, tok) == model.get(path, -1)
        assert len(trie.tokens) == len(paths) <= budget
    tree = trie.flatten(0)
    check_tree_shape(tree, root, budget)
    assert sorted(tree_paths(tree)) == sorted(paths[1:]), "flatten lost or invented nodes"
    # stable: within a depth, nodes keep insertion order
    by_depth = sorted(paths[1:], key=len)
    assert tree_paths(tree) == by_depth


# -- retrieval borders -------------------------------------------------------------------------------
@FAST
@given(st.integers(1, 6), ctx_st | small_ctx_st, st.integers(0, 5), st.integers(1, 4))
def test_retrieval_borders_brute_force(window, ctx, root, min_depth):
    a = Automaton(window, BIG)
    a.extend(ctx)
    subs = substring_counts(ctx, window)
    borders = retrieval_borders(a, root, min_depth)
    expect = [
        suffix(ctx, L) + (root,)
        for L in range(min(len(ctx), window), -1, -1)
        if L + 1 >= min_depth and suffix(ctx, L) + (root,) in subs
    ]
    assert [a.string(b) for b in borders] == expect


# -- retrieval expansion -----------------------------------------------------------------------------
def _retrieval(ctx, window, root, budget, min_depth, min_prob=0.0):
    a = Automaton(window, BIG)
    a.extend(ctx)
    trie = _Trie(root, budget)
    n = add_retrieval(trie, a, root, min_depth, min_prob)
    tree = trie.flatten(n)
    check_tree_shape(tree, root, budget)
    assert n == len(tree) - 1, "n_retrieval must count every non-root node retrieval added"
    return tree


def _acceptance_estimates(ctx, window, root, min_depth, backoff=Fraction(1, 2)):
    """Exact p for every reference path, following the documented ranking: the product along the
    path of count(ctx'+child)/count(ctx') in the deepest border context that still holds the child,
    times ``backoff`` when that context is shallower than the deepest one holding the parent."""
    counts = substring_counts(ctx, window)
    Ls = [
        L
        for L in range(min(len(ctx), window), -1, -1)
        if L + 1 >= min_depth and suffix(ctx, L) + (root,) in counts
    ]

    def holders(path):
        return [L for L in Ls if suffix(ctx, L) + (root,) + path in counts]

    p = {(): Fraction(1)}
    todo = deque([()])
    while todo:
        path = todo.popleft()
        hs = holders(path)
        if not hs:
            continue
        nxt = {s[-1] for s in counts if len(s) >= 1 and any(s[:-1] == suffix(ctx, L) + (root,) + path for L in hs)}
        for x in nxt:
            child = path + (x,)
            ch = holders(child)
            top = ch[0]
            head = suffix(ctx, top) + (root,) + path
            q = p[path] * Fraction(counts[head + (x,)], counts[head])
            if top != hs[0]:
                q *= backoff
            p[child] = q
            todo.append(child)
    del p[()]
    return p


@FAST
@given(st.integers(1, 6), ctx_st | small_ctx_st, st.integers(0, 5), st.integers(1, 3))
def test_retrieval_with_ample_budget_is_exactly_the_occurring_continuations(window, ctx, root, min_depth):
    ref = retrieval_paths_reference(ctx, root, window, min_depth)
    tree = _retrieval(ctx, window, root, len(ref) + 1 + 5, min_depth)
    assert set(tree_paths(tree)) == ref


@FAST
@given(st.integers(1, 6), ctx_st | small_ctx_st, st.integers(0, 5), st.integers(1, 3), st.integers(1, 70))
def test_retrieval_budget_fill_and_soundness(window, ctx, root, min_depth, budget):
    ref = retrieval_paths_reference(ctx, root, window, min_depth)
    tree = _retrieval(ctx, window, root, budget, min_depth)
    assert set(tree_paths(tree)) <= ref
    assert len(tree) == min(budget, 1 + len(ref)), "retrieval left budget unused while candidates remained"


@FAST
@given(st.integers(2, 6), small_ctx_st | ctx_st, st.integers(0, 5), st.integers(1, 3), st.integers(2, 40))
def test_retrieval_keeps_the_most_probable_candidates(window, ctx, root, min_depth, budget):
    """Best-first: no candidate left out (a child of a drafted node) has a higher estimated acceptance
    probability than any drafted node; estimates never increase along a path."""
    p = _acceptance_estimates(ctx, window, root, min_depth)
    assert set(p) == retrieval_paths_reference(ctx, root, window, min_depth)
    for path, q in p.items():
        assert 0 < q <= 1
        if len(path) > 1:
            assert q <= p[path[:-1]]
    tree = _retrieval(ctx, window, root, budget, min_depth)
    drafted = set(tree_paths(tree))
    if not drafted:
        return
    left_out = [q for path, q in p.items() if path not in drafted and path[:-1] in drafted | {()}]
    if left_out:
        assert max(left_out) <= min(p[d] for d in drafted), "a better candidate was left out"


@FAST
@given(
    st.integers(2, 6),
    small_ctx_st | ctx_st,
    st.integers(0, 5),
    st.integers(1, 3),
    st.sampled_from([0.05, 0.1, 0.2, 0.25, 0.34, 0.5, 0.9, 1.0]),
)
def test_retrieval_min_prob_prunes_exactly(window, ctx, root, min_depth, min_prob):
    p = _acceptance_estimates(ctx, window, root, min_depth)
    tree = _retrieval(ctx, window, root, len(p) + 10, min_depth, min_prob)
    keep = {path for path, q in p.items() if q >= Fraction(min_prob) * (1 + Fraction(1, 10**9))}
    maybe = {path for path, q in p.items() if q >= Fraction(min_prob) * (1 - Fraction(1, 10**9))}
    assert keep <= set(tree_paths(tree)) <= maybe


# -- logits expansion --------------------------------------------------------------------------------
def _logits_reference(table: dict, root: int, root_breadth: int, budget: int) -> list[tuple]:
    """Breadth-first, node by node: a node of breadth b takes the first b of its row; the j-th of
    them (0-based) gets breadth max(1, b >> (j+1)). Paths of the first budget-1 nodes."""
    out: list[tuple] = []
    seen = set()
    queue = deque([((), root, root_breadth)])
    while queue and len(out) < budget - 1:
        path, tok, b = queue.popleft()
        for j, t in enumerate(table.get(tok, ())[:b]):
            child = path + (t,)
            if child not in seen:
                if len(out) >= budget - 1:
                    break
                seen.add(child)
                out.append(child)
            queue.append((child, t, max(1, b >> (j + 1))))
    return out


table_st = st.dictionaries(
    st.integers(0, 5), st.lists(st.integers(0, 5), unique=True, max_size=6), max_size=6
)


@FAST
@given(st.integers(0, 5), table_st, st.integers(1, 8), st.integers(1, 70))
def test_add_logits_matches_reference_bfs(root, table, breadth, budget):
    trie = _Trie(root, budget)
    add_logits(trie, lambda t: tuple(table.get(t, ())), breadth)
    tree = trie.flatten(0)
    check_tree_shape(tree, root, budget)
    assert tree_paths(tree) == _logits_reference(table, root, breadth, budget)
    kids = tree_children(tree)
    assert len(kids[0]) <= breadth
    for i, ch in enumerate(kids):
        allowed = table.get(tree.tokens[i], ())
        assert [tree.tokens[c] for c in ch] == list(allowed[: len(ch)]), "children are not a prefix of the row"


@FAST
@given(st.integers(0, 5), st.integers(1, 6), st.integers(1, 70), st.randoms(use_true_random=False))
def test_add_logits_fills_budget_with_complete_table(root, k, budget, rnd):
    table = {t: rnd.sample(range(6), k) for t in range(6)}
    trie = _Trie(root, budget)
    add_logits(trie, lambda t: tuple(table[t]), k)
    assert len(trie.tokens) == budget
