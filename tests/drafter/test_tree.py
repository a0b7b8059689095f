"""Property tests for drafter.tree: the draft trie, retrieval borders/expansion and logits expansion.

References are computed on the token list (occurrence counts of substrings), never from the
automaton, and the automaton is unbounded here (the eviction bug is covered in test_automaton.py).
"""

from __future__ import annotations

from collections import deque
from fractions import Fraction

from hypothesis import example, given, settings
from hypothesis import strategies as st

from drafter.automaton import Automaton
from drafter.tree import RANK_PRIOR, _Trie, add_logits, add_logits_best_first, add_retrieval, retrieval_borders

from .refs import (
    best_first_frontier,
    check_tree_shape,
    logits_reference,
    rank_value,
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
        assert trie.index.get((parent, tok), -1) == model.get(path, -1)
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


def _acceptance_estimates(ctx, window, root, min_depth, backoff=Fraction(1, 2), with_ties=False):
    """Exact p for every reference path, following the documented ranking: the product along the
    path of count(ctx'+child)/count(ctx') in the deepest border context that still holds the child,
    times ``backoff`` when that context is shallower than the deepest one holding the parent."""
    counts = substring_counts(ctx, window)
    Ls = [L for L in range(min(len(ctx), window), -1, -1) if L + 1 >= min_depth and suffix(ctx, L) + (root,) in counts]

    def holders(path):
        return [L for L in Ls if suffix(ctx, L) + (root,) + path in counts]

    p = {(): Fraction(1)}
    pf = {(): 1.0}  # the same estimate in float, operation for operation (what the heap compares)
    tie = {}  # secondary key: count of the child in the shallowest context still holding it
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
            qf = pf[path] * counts[head + (x,)] / max(counts[head], 1)
            if top != hs[0]:
                q *= backoff
                qf *= float(backoff)
            p[child] = q
            pf[child] = qf
            tie[child] = counts[suffix(ctx, ch[-1]) + (root,) + child]
            todo.append(child)
    del p[()]
    if with_ties:
        return p, pf, tie
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
@given(st.integers(2, 6), small_ctx_st | ctx_st, st.integers(0, 5), st.integers(1, 3), st.integers(2, 40))
# continuations 0 and 2 of "0 1" both get p = 1/2 * backoff; 0 follows "1" twice, 2 once: 0 wins
@example(3, [1, 0, 1, 2, 0, 1, 0], 1, 1, 2)
def test_retrieval_ties_broken_by_raw_frequency(window, ctx, root, min_depth, budget):
    """Among candidates with the same estimate (as compared in float), the more frequent one (count
    in the shallowest context that still holds it) is drafted first: no left-out candidate beats a
    drafted node on (estimate, frequency)."""
    p, pf, tie = _acceptance_estimates(ctx, window, root, min_depth, with_ties=True)
    drafted = set(tree_paths(_retrieval(ctx, window, root, budget, min_depth)))
    if not drafted:
        return
    worst = min((pf[d], tie[d]) for d in drafted)
    for path in p:
        if path not in drafted and path[:-1] in drafted | {()}:
            assert (pf[path], tie[path]) <= worst, f"left out {path} {(pf[path], tie[path])} > drafted {worst}"


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
table_st = st.dictionaries(st.integers(0, 5), st.lists(st.integers(0, 5), unique=True, max_size=6), max_size=6)


@FAST
@given(st.integers(0, 5), table_st, st.integers(1, 8), st.integers(1, 70))
def test_add_logits_matches_reference_bfs(root, table, breadth, budget):
    trie = _Trie(root, budget)
    add_logits(trie, lambda t: tuple(table.get(t, ())), breadth)
    tree = trie.flatten(0)
    check_tree_shape(tree, root, budget)
    assert tree_paths(tree) == logits_reference(table, root, breadth, budget)
    kids = tree_children(tree)
    assert len(kids[0]) <= breadth
    for i, ch in enumerate(kids):
        allowed = table.get(tree.tokens[i], ())
        assert [tree.tokens[c] for c in ch] == list(allowed[: len(ch)]), "children are not a prefix of the row"
    for i in range(1, len(trie.tokens)):  # a node's value: its parent's times the rank prior of its rank
        parent = trie.parents[i]
        rank = table[trie.tokens[parent]].index(trie.tokens[i])
        assert trie.value[i] == trie.value[parent] * RANK_PRIOR[min(rank, len(RANK_PRIOR) - 1)]


@FAST
@given(st.integers(0, 5), st.integers(1, 6), st.integers(1, 70), st.randoms(use_true_random=False))
def test_add_logits_fills_budget_with_complete_table(root, k, budget, rnd):
    table = {t: rnd.sample(range(6), k) for t in range(6)}
    trie = _Trie(root, budget)
    add_logits(trie, lambda t: tuple(table[t]), k)
    assert len(trie.tokens) == budget


# -- best-first logits expansion ---------------------------------------------------------------------
rank_prob_st = st.one_of(
    st.just(None),  # the module default (RANK_PRIOR)
    st.lists(st.sampled_from([1.0, 0.5, 0.45, 0.25, 0.14, 0.1, 0.07, 0.03, 0.01]), min_size=1, max_size=8).map(
        lambda xs: tuple(sorted(xs, reverse=True))
    ),
)


def _run_best_first(trie, get, rank_prob):
    if rank_prob is None:
        add_logits_best_first(trie, get)
        import drafter.tree as tree_mod

        return tree_mod.RANK_PRIOR
    add_logits_best_first(trie, get, rank_prob)
    return rank_prob


@FAST
@given(
    st.integers(0, 5),
    table_st,
    rank_prob_st,
    st.integers(1, 70),
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=6),
)
def test_add_logits_best_first_spends_budget_on_the_most_probable_nodes(root, table, rank_prob, budget, pre):
    """Optionally on top of pre-existing (retrieval-like) paths: the added nodes are table successors
    (within the rank prior's width), no unexplored table successor is worth more than an added node,
    the budget is only left unused when there is nothing left to expand, pre-existing nodes stay
    and are not paid for twice."""
    get = lambda t: tuple(table.get(t, ()))  # noqa: E731
    trie = _Trie(root, budget)
    for path in pre:
        node = 0
        for t in path:
            node = trie.add(node, t)
            if node < 0:
                break
    before = set(tree_paths(trie.flatten(0)))
    rp = _run_best_first(trie, get, rank_prob)
    tree = trie.flatten(0)
    check_tree_shape(tree, root, budget)
    after = set(tree_paths(tree))
    assert before <= after
    added = after - before
    width = len(rp)
    values = {p: rank_value(get, root, p, rp) for p in added}  # asserts table-consistency
    frontier = best_first_frontier(get, root, after, width)
    if len(tree) < budget:
        assert not frontier, f"budget left unused but {sorted(frontier)[:3]} could be expanded"
    if added and frontier:
        best_left = max(rank_value(get, root, p, rp) for p in frontier)
        assert best_left <= min(values.values()), "a more probable successor was left out"


@FAST
@given(st.integers(0, 5), st.integers(1, 6), st.integers(1, 70), st.randoms(use_true_random=False))
def test_add_logits_best_first_fills_budget_with_complete_table(root, k, budget, rnd):
    table = {t: rnd.sample(range(6), k) for t in range(6)}
    trie = _Trie(root, budget)
    add_logits_best_first(trie, lambda t: tuple(table[t]))
    assert len(trie.tokens) == budget


def test_with_path_follows_existing_nodes_and_appends_the_rest():
    from drafter.tree import DraftTree

    tree = DraftTree((5, 6, 7, 8), (-1, 0, 0, 1), 1, (0, 1, 2, 3))
    grown = tree.with_path([6, 8, 9, 10])
    assert grown.tokens == (5, 6, 7, 8, 9, 10) and grown.parents == (-1, 0, 0, 1, 3, 4)
    assert all(p < i for i, p in enumerate(grown.parents)) and grown.ranks == (0, 1, 2, 3, 4, 5)
    assert tree.with_path([7]) is tree  # already a path of the tree
