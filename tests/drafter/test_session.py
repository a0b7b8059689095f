"""Property tests for drafter.draft_session.DraftSession: every mode against brute force on the history.

Sessions here use an unbounded automaton (max_nodes far above the distinct substrings), so the
retrieval references are exact.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import drafter.tree as tree_mod
from common.params import MODES
from drafter.draft_session import DrafterConfig, DraftSession

from .refs import (
    best_first_frontier,
    check_tree_shape,
    logits_reference,
    pld_reference,
    rank_value,
    retrieval_paths_reference,
    tree_children,
    tree_paths,
)

FAST = settings(max_examples=120, deadline=None)
BIG = 10**9
ALPHA = 6
LOGITS_TREES = ("halving", "best-first")

row_st = st.lists(st.integers(0, ALPHA - 1), unique=True, min_size=0, max_size=ALPHA)


@st.composite
def configs(draw):
    return DrafterConfig(
        window=draw(st.integers(1, 5)),
        max_nodes=BIG,
        topk=draw(st.integers(1, ALPHA)),
        min_depth=draw(st.integers(1, 3)),
        pld_ngram=draw(st.integers(1, 4)),
        logits_tree=draw(st.sampled_from(LOGITS_TREES)),
    )


@st.composite
def sessions(draw, cfg=None):
    """A session fed in chunks (with or without top-k rows) plus verified trees; returns it and its
    committed history."""
    cfg = cfg or draw(configs())
    # optional model prior: rows for tokens 0..vocab-1 (permutations, so ranks are unambiguous)
    vocab = draw(st.integers(0, ALPHA))
    prior = draw(st.none() | st.just([draw(st.permutations(range(ALPHA))) for _ in range(vocab)]))
    s = DraftSession(cfg, prior=prior)
    history = []
    for _ in range(draw(st.integers(0, 5))):
        chunk = draw(st.lists(st.integers(0, ALPHA - 1), max_size=15))
        if draw(st.booleans()):
            s.extend(chunk, [draw(row_st) for _ in chunk])
        else:
            s.extend(chunk)
        history += chunk
        if draw(st.booleans()):
            tt, tk, acc = draw(verified_trees())
            s.observe_tree(tt, tk, acc)
            s.extend([tt[i] for i in acc])
            history += [tt[i] for i in acc]
    assert s.history == history
    return s, history


@st.composite
def verified_trees(draw):
    """(tree_tokens, tree_topk, accepted): a random tree and a root-first path into it."""
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, ALPHA - 1)) for _ in range(n)]
    topk = [draw(row_st) for _ in range(n)]
    node = draw(st.integers(0, n - 1))
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    accepted = path[::-1]
    if draw(st.booleans()):
        accepted = accepted[: draw(st.integers(1, len(accepted)))]
    return tokens, topk, accepted


def paths(tree):
    return set(tree_paths(tree))


# -- shape, every mode -----------------------------------------------------------------------------------
@FAST
@given(sessions(), st.integers(0, ALPHA - 1), st.integers(1, 70), st.sampled_from(MODES))
def test_every_mode_gives_a_well_formed_tree_within_budget(sess, root, budget, mode):
    s, _ = sess
    tree = s.draft(root, budget, mode)
    check_tree_shape(tree, root, budget)
    if mode not in ("racer", "retrieval"):
        assert tree.n_retrieval == 0
    if mode == "retrieval":
        assert tree.n_retrieval == len(tree) - 1
    if mode in ("off",) or budget == 1:
        assert tree.tokens == (root,) and tree.parents == (-1,) and tree.n_retrieval == 0


@FAST
@given(sessions(), st.integers(0, ALPHA - 1), st.integers(1, 70), st.sampled_from(MODES))
def test_draft_is_pure(sess, root, budget, mode):
    """Drafting twice gives the same tree and changes no state."""
    s, _ = sess
    before = (s.automaton.to_state(), dict(s.table.rows), s.last_topk, list(s.history))
    t1 = s.draft(root, budget, mode)
    t2 = s.draft(root, budget, mode)
    assert t1 == t2
    assert before == (s.automaton.to_state(), dict(s.table.rows), s.last_topk, list(s.history))


@given(sessions(), st.integers(0, ALPHA - 1), st.text(max_size=8))
def test_invalid_mode_and_budget_raise(sess, root, mode):
    s, _ = sess
    if mode not in MODES:
        with pytest.raises(ValueError):
            s.draft(root, 8, mode)
    for bad in (-1, -70):
        for m in MODES:
            with pytest.raises(ValueError):
                s.draft(root, bad, m)
    for m in MODES:  # 0 is the adaptive budget: it needs the verifier's cost curve, except for "off"
        if m == "off":
            assert s.draft(root, 0, m).tokens == (root,)
        else:
            with pytest.raises(ValueError, match="cost curve"):
                s.draft(root, 0, m)


@given(st.integers(1, 6), st.integers(-3, 0), st.sampled_from(["topk", "min_depth", "pld_ngram"]))
def test_config_validation(window, bad, field):
    with pytest.raises(ValueError):
        DrafterConfig(window=window, max_nodes=BIG, **{field: bad})
    with pytest.raises(ValueError):
        DrafterConfig(window=0)
    with pytest.raises(ValueError):
        DrafterConfig(window=window, max_nodes=BIG, logits_tree="widest")
    with pytest.raises(ValueError):
        DrafterConfig(window=window, max_nodes=window * (window + 1))
    DrafterConfig(window=window, max_nodes=window * (window + 1) + 1)


# -- retrieval ---------------------------------------------------------------------------------------------
@FAST
@given(sessions(), st.integers(0, ALPHA - 1), st.integers(1, 70))
def test_retrieval_mode_against_brute_force(sess, root, budget):
    s, history = sess
    cfg = s.config
    ref = retrieval_paths_reference(history, root, cfg.window, cfg.min_depth)
    tree = s.draft(root, budget, "retrieval")
    got = paths(tree)
    assert got <= ref, f"drafted continuations never seen after a context suffix + root: {got - ref}"
    assert len(tree) == min(budget, 1 + len(ref))
    if not ref:
        assert tree.tokens == (root,)


# -- logits / last-logit ---------------------------------------------------------------------------------
def _check_logits_tree(s: DraftSession, tree, root, budget, get):
    """Logits-only draft built from ``get``: halving = the exact breadth-first reference; best-first =
    table successors, most probable first, budget filled unless nothing is left to expand."""
    k = s.config.topk
    kids = tree_children(tree)
    if s.config.logits_tree == "halving":
        assert len(kids[0]) <= k
        for i, ch in enumerate(kids):
            row = tuple(get(tree.tokens[i]))
            got = [tree.tokens[c] for c in ch]
            assert got == list(row[: len(got)]), f"children of {tree.tokens[i]} are not the best-ranked prefix of {row}"
        table = {t: tuple(get(t))[:k] for t in range(ALPHA)}
        assert tree_paths(tree) == logits_reference(table, root, k, budget)
    else:
        rp = tree_mod.RANK_PRIOR
        drafted = set(tree_paths(tree))
        values = {p: rank_value(get, root, p, rp) for p in drafted}  # asserts table successors
        frontier = best_first_frontier(get, root, drafted, len(rp))
        if len(tree) < budget:
            assert not frontier, "budget left unused with successors left to expand"
        if drafted and frontier:
            assert max(rank_value(get, root, p, rp) for p in frontier) <= min(values.values())
    if not tuple(get(root)):
        assert len(tree) == 1


@FAST
@given(sessions(), st.integers(0, ALPHA - 1), st.integers(1, 70))
def test_logits_mode_children_come_from_the_table(sess, root, budget):
    s, _ = sess
    tree = s.draft(root, budget, "logits")
    assert len(tree_children(tree)[0]) <= s.config.topk
    for i, ch in enumerate(tree_children(tree)):
        row = s.table.get(tree.tokens[i])
        assert len(row) <= s.config.topk
        assert {tree.tokens[c] for c in ch} <= set(row), f"child of {tree.tokens[i]} not in its copy-logit row {row}"
    _check_logits_tree(s, tree, root, budget, s.table.get)


@FAST
@given(sessions(), st.integers(0, ALPHA - 1), st.integers(1, 70))
def test_last_logit_mode_uses_only_the_last_distribution(sess, root, budget):
    s, _ = sess
    tree = s.draft(root, budget, "last-logit")
    last = tuple(s.last_topk)
    for ch in tree_children(tree):
        assert {tree.tokens[c] for c in ch} <= set(last)
    if not last:
        assert len(tree) == 1
    elif budget > 1:
        assert len(tree) == budget  # one distribution for every node: the expansion never runs dry
    _check_logits_tree(s, tree, root, budget, lambda _t: last)


# -- racer (merge) -------------------------------------------------------------------------------------------
def _complete_table(s: DraftSession, history, rnd):
    """Gives every token k distinct successors, ranked with the ones seen in the history first (so
    logits paths overlap retrieval paths as much as possible)."""
    k = s.config.topk
    for t in range(ALPHA):
        seen = []
        for i in range(len(history) - 1):
            if history[i] == t and history[i + 1] not in seen:
                seen.append(history[i + 1])
        rest = [x for x in range(ALPHA) if x not in seen]
        rnd.shuffle(rest)
        s.table.put(t, (seen + rest)[:k])


@FAST
@given(sessions(), st.integers(0, ALPHA - 1), st.integers(1, 70), st.booleans(), st.randoms(use_true_random=False))
def test_racer_is_retrieval_first_then_logits(sess, root, budget, complete, rnd):
    s, history = sess
    if complete:
        _complete_table(s, history, rnd)
    racer = s.draft(root, budget, "racer")
    retr = s.draft(root, budget, "retrieval")
    logi = s.draft(root, budget, "logits")
    R, L, U = paths(retr), paths(logi), paths(racer)
    assert racer.n_retrieval == retr.n_retrieval == len(retr) - 1
    assert R <= U, "racer dropped retrieval paths: retrieval must get the budget first"
    assert U <= R | L, f"racer drafted paths from neither tree: {U - (R | L)}"
    assert len(racer) >= min(budget, len(logi)), "merge left budget unused (overlap paid twice?)"
    assert len(racer) >= len(retr)
    if len(racer) < budget:
        assert L <= U, "budget left over but logits paths missing"
    if complete:
        assert len(logi) == budget
        assert len(racer) == budget, "racer did not fill the budget although the logits tree alone does"


# -- prompt lookup ---------------------------------------------------------------------------------------------
@FAST
@given(sessions(), st.integers(0, ALPHA - 1), st.integers(1, 70))
def test_pld_mode_against_brute_force(sess, root, budget):
    s, history = sess
    tree = s.draft(root, budget, "pld")
    chain = pld_reference(history, root, s.config.pld_ngram, budget) if budget > 1 else ()
    assert tree.tokens == (root, *chain)
    assert tree.parents == tuple(range(-1, len(chain)))
    assert tree.n_retrieval == 0


@FAST
@given(
    st.integers(1, 4),
    st.lists(st.integers(0, 2), max_size=40),
    st.integers(0, 2),
    st.integers(1, 70),
    st.lists(st.integers(0, 40), max_size=6),
)
def test_pld_independent_of_chunking(ngram, history, root, budget, cuts):
    """The n-gram index built by extend() must not depend on how the history was chunked."""
    cfg = DrafterConfig(window=3, max_nodes=BIG, pld_ngram=ngram)
    one = DraftSession(cfg)
    one.extend(history)
    many = DraftSession(cfg)
    prev = 0
    for c in sorted(min(c, len(history)) for c in cuts) + [len(history)]:
        many.extend(history[prev:c])
        prev = c
    assert one.draft(root, budget, "pld") == many.draft(root, budget, "pld")
    assert one.draft(root, budget, "pld").tokens == (
        root,
        *(pld_reference(history, root, ngram, budget) if budget > 1 else ()),
    )


# -- learning -----------------------------------------------------------------------------------------------
@FAST
@given(sessions(), verified_trees())
def test_observe_tree_table_reference(sess, vt):
    """Every node's row is written, accepted path last: a token's row is the one at its last accepted
    occurrence, else at its last occurrence in tree order, else unchanged; rows truncated to k."""
    s, _ = sess
    tt, tk, acc = vt
    k = s.config.topk
    expect = dict(s.table.rows)
    for i, (t, row) in enumerate(zip(tt, tk)):
        if i not in acc:
            expect[t] = tuple(row)[:k]
    for i in acc:
        expect[tt[i]] = tuple(tk[i])[:k]
    last_before = s.last_topk
    s.observe_tree(tt, tk, acc)
    assert s.table.rows == expect
    assert s.last_topk == (tuple(tk[acc[-1]]) if acc else last_before)


@FAST
@given(sessions(), st.lists(st.integers(0, ALPHA - 1), min_size=1, max_size=10), st.data())
def test_extend_records_history_table_and_last_topk(sess, tokens, data):
    s, history = sess
    k = s.config.topk
    rows = [data.draw(row_st) for _ in tokens]
    expect = dict(s.table.rows)
    for t, r in zip(tokens, rows):
        expect[t] = tuple(r)[:k]
    s.extend(iter(tokens), rows)  # any iterable of tokens
    assert s.history == history + tokens
    assert s.automaton.length == len(s.history)
    assert s.table.rows == expect
    assert s.last_topk == tuple(rows[-1])


def test_extend_with_more_rows_than_tokens_leaves_state_unchanged():
    s = DraftSession(DrafterConfig(window=3, max_nodes=BIG))
    s.extend([0, 1, 2])
    before = (s.automaton.to_state(), list(s.history), dict(s.table.rows))
    with pytest.raises(ValueError):
        s.extend([1], topk_rows=[[3], [4]])
    assert (s.automaton.to_state(), list(s.history), dict(s.table.rows)) == before


def test_fewer_rows_than_tokens_are_the_last_tokens_rows():
    s = DraftSession(DrafterConfig(window=3, max_nodes=BIG))
    s.extend([5, 6, 7], topk_rows=[[1], [2]])
    assert s.history == [5, 6, 7]
    assert s.table.rows == {6: (1,), 7: (2,)} and s.last_topk == (2,)
    s.extend([8], topk_rows=[])  # none: the table and the last row stay
    assert s.table.rows == {6: (1,), 7: (2,)} and s.last_topk == (2,)


@FAST
@given(
    st.integers(2, 4),
    st.integers(0, 30),
    st.integers(1, 3),
    st.lists(st.integers(0, 3), min_size=20, max_size=80),
    st.integers(0, 3),
    st.integers(2, 40),
)
@example(2, 1, 1, [0, 3, 1, 2, 1, 0, 0, 2, 0, 0], 0, 8)
@example(3, 3, 1, [0, 0, 1, 1, 0, 2, 2, 0, 0, 0], 2, 64)
def test_small_capacity_session_extends_and_drafts_soundly(window, extra, min_depth, history, root, budget):
    """With eviction, extend() must not fail and retrieval must still only draft continuations that
    occurred (within the window) after a context suffix + root."""
    cfg = DrafterConfig(window=window, max_nodes=window * (window + 1) + 1 + extra, min_depth=min_depth)
    s = DraftSession(cfg)
    s.extend(history)
    ref = retrieval_paths_reference(history, root, window, min_depth)
    tree = s.draft(root, budget, "retrieval")
    check_tree_shape(tree, root, budget)
    assert paths(tree) <= ref
