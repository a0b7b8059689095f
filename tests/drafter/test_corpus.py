"""The tenant corpus against a brute-force reference written over the plain list of responses.

The reference numbers every token in the order the chunks were appended (so streams interleave),
keeps only the last ``capacity`` positions alive, and finds the longest match by comparing the
context backwards with each live occurrence of the root in its own response that has a next token.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.corpus import Corpus, CorpusConfig
from drafter.draft_session import DrafterConfig, DraftSession
from drafter.tree import _Trie, add_corpus, corpus_candidates, corpus_confidence

from .refs import check_tree_shape


class Reference:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.total = 0
        self.where: dict[int, tuple[int, int]] = {}  # position -> (response, index in it)
        self.responses: list[list[tuple[int, int]]] = []  # per response: (position, token)

    def writer(self) -> int:
        self.responses.append([])
        return len(self.responses) - 1

    def append(self, w: int, tokens) -> None:
        tokens = list(tokens)[-self.capacity :]
        if len(tokens) == self.capacity:
            self.responses[w] = []  # a chunk that fills the ring starts the response over
        for t in tokens:
            self.where[self.total] = (w, len(self.responses[w]))
            self.responses[w].append((self.total, t))
            self.total += 1

    def live(self, pos: int) -> bool:
        return pos >= self.total - self.capacity

    def match(self, cfg: CorpusConfig, context, root) -> tuple[int, list[int]]:
        if len(context) < cfg.key_len - 1:
            return 0, []
        want = [*context, root]
        best, found = 0, []
        for pos in sorted(self.where, reverse=True):
            if not self.live(pos):
                continue
            w, i = self.where[pos]
            resp = self.responses[w]
            if i + 1 >= len(resp):
                continue  # nothing follows it: no candidate
            length = 0
            while length < cfg.max_match and i - length >= 0 and length < len(want):
                p, t = resp[i - length]
                if not self.live(p) or t != want[-1 - length]:
                    break
                length += 1
            if length < cfg.key_len:
                continue
            if length > best:
                best, found = length, [pos]
            elif length == best:
                found.append(pos)
        return best, found

    def continuation(self, pos: int, depth: int) -> list[int]:
        w, i = self.where[pos]
        return [t for _, t in self.responses[w][i + 1 : i + 1 + depth]]


ops_st = st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=0, max_size=12)), min_size=1, max_size=14
)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 40),
    key_len=st.integers(1, 3),
    ops=ops_st,
    context=st.lists(st.integers(0, 3), max_size=10),
    root=st.integers(0, 3),
    initial=st.integers(1, 8),
)
def test_match_and_continuations_equal_brute_force(capacity, key_len, ops, context, root, initial):
    """``initial``: the arrays start that small and grow (re-indexed) on the way to the capacity."""
    cfg = CorpusConfig(max_tokens=capacity, key_len=key_len, max_match=8, max_scan=10_000, max_candidates=10_000)
    corpus, ref = Corpus(cfg, initial), Reference(capacity)
    writers: dict[int, tuple] = {}
    for w, chunk in ops:
        if w not in writers:
            writers[w] = (corpus.writer(), ref.writer())
        cw, rw = writers[w]
        corpus.append(cw, chunk)
        ref.append(rw, chunk)
    assert len(corpus) == min(ref.total, capacity)
    assert corpus.size <= capacity
    got = corpus.match(context, root)
    want = ref.match(cfg, context, root)
    assert got == want
    for p in got[1]:
        assert corpus.continuation(p, 6) == ref.continuation(p, 6)


def test_eviction_at_the_bound_drops_the_oldest_response_first():
    corpus = Corpus(CorpusConfig(max_tokens=20, key_len=2))
    old, new = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    corpus.add(old)
    corpus.add(new)
    assert len(corpus) == 20
    assert corpus.match([1, 2], 3)[0] == 3  # both still held
    corpus.add([30, 31, 32, 33, 34])  # five over the bound: the oldest response's first five go
    assert len(corpus) == 20
    assert corpus.match([2, 3], 4) == (0, [])
    assert corpus.match([5, 6], 7)[0] == 2  # the old response's newer part stays, cut where it was evicted
    assert corpus.match([12, 13], 14)[0] == 3
    # a response longer than the bound keeps its newest tokens
    corpus.add(list(range(100, 150)))
    assert len(corpus) == 20
    assert corpus.match([12], 13) == (0, [])
    assert corpus.match([128, 129], 130)[0] == 0  # key 129,130 is older than the bound
    assert corpus.match([146, 147], 148)[0] == 3
    assert corpus.match([147, 148], 149) == (0, []), "the response's last token: nothing follows it"
    assert corpus.continuation(corpus.match([146], 147)[1][0], 5) == [148, 149]


def test_a_response_streamed_in_chunks_between_others_reads_as_one():
    corpus = Corpus(CorpusConfig(max_tokens=100, key_len=2))
    a, b = corpus.writer(), corpus.writer()
    corpus.append(a, [1, 2, 3])
    corpus.append(b, [7, 7, 7])
    corpus.append(a, [4, 5, 6])
    length, positions = corpus.match([0, 1, 2], 3)
    assert length == 3  # 0 is not in the corpus: 1 2 3
    assert corpus.continuation(positions[0], 10) == [4, 5, 6]
    assert corpus.match([3], 4)[0] == 2  # the key across the chunk boundary is indexed


def test_frequency_ranks_the_continuation_most_occurrences_share():
    corpus = Corpus(CorpusConfig(max_tokens=1000, key_len=3))
    for _ in range(3):
        corpus.add([1, 2, 3, 4, 5, 6, 7])
    corpus.add([1, 2, 3, 4, 9, 9, 9])
    cands = dict((path, v) for v, path in corpus_candidates(corpus, [1, 2, 3], 4, depth=3, min_match=4))
    assert cands[(5,)] > cands[(9,)]
    trie = _Trie(4, 64)
    # a 4-token match: 5, 6, 7 worth 0.75 x 4/6, x 5/7 (the match is 5 tokens if 5 is accepted),
    # x 6/8 = 0.27; the rarer 9 (0.25 x 4/6) and 8 deep (0.75 x 4/6 x 5/7 x 6/8 x 7/9) are not
    assert add_corpus(trie, corpus_candidates(corpus, [1, 2, 3], 4, 63, 4), 0.25) == 3
    assert trie.tokens == [4, 5, 6, 7] and trie.corpus == [1, 2, 3]


def _draft(session, root=7, budget=24):
    t = session.draft(root, budget)
    return t.tokens, t.parents


def test_an_empty_or_unmatched_corpus_leaves_the_tree_as_it_was():
    ctx = [5, 6, 7, 8, 5, 6, 9, 1, 2, 5, 6]
    plain, with_empty, with_other = (DraftSession(DrafterConfig(window=4)) for _ in range(3))
    with_empty.corpus = Corpus(CorpusConfig(max_tokens=1000))
    with_other.corpus = Corpus(CorpusConfig(max_tokens=1000))
    with_other.corpus.add([40, 41, 42, 43, 44, 45, 46] * 5)
    for s in (plain, with_empty, with_other):
        s.extend(ctx, [[(t + 1) % 50, (t + 2) % 50] for t in ctx])
    assert _draft(plain) == _draft(with_empty) == _draft(with_other)
    assert not with_other.draft(7, 24).corpus_nodes


def test_a_repeated_answer_drafts_a_deep_chain_from_the_corpus():
    answer = list(range(20, 50))
    s = DraftSession(DrafterConfig(window=4))
    s.corpus = Corpus(CorpusConfig(max_tokens=1000))
    s.corpus.add(list(range(1, 12)) + answer)
    s.extend([0, *range(1, 12), 20, 21])  # a 14-token match with the root: 14/16 for the first token
    tree = s.draft(22, 32)
    chain = [22]
    node = 0
    while True:
        kids = [i for i, p in enumerate(tree.parents) if p == node and tree.tokens[i] == answer[len(chain) + 2]]
        if not kids or len(chain) >= len(answer) - 2:
            break
        node = kids[0]
        chain.append(tree.tokens[node])
    # the d-th token continues a match of 13 + d tokens: 14/16 x 15/17 x ... = 14 x 15 / ((14 + d) (15 + d)),
    # >= 0.25 for 14 tokens, < 0.25 for 15
    assert chain == answer[2 : 2 + len(chain)] and len(chain) == 15
    assert len(tree.corpus_nodes) == 14
    assert all(tree.tokens[i] in answer for i in tree.corpus_nodes)
    # a prefix of the tree (adaptive budget) keeps the corpus nodes it holds, renumbered
    small = tree.prefix(6)
    assert all(small.tokens[i] in answer for i in small.corpus_nodes) and small.corpus_nodes


def test_the_observed_corpus_acceptance_sets_how_deep_corpus_paths_go():
    corpus = Corpus(CorpusConfig(max_tokens=1000, key_len=3))
    corpus.add(list(range(1, 40)))
    ctx, root = [1, 2, 3, 4], 5  # a 5-token match: prior confidence 5/7 for the first token

    def depth(*observed):
        return max((len(p) for v, p in corpus_candidates(corpus, ctx, root, 30, 4, observed) if v >= 0.25), default=0)

    prior = depth()
    assert prior == depth((0, 0)) == 5  # 5 x 6 / (10 x 11) >= 0.25 > 5 x 6 / (11 x 12)
    assert depth((40, 40)) > prior + 10  # every corpus node the target was asked about was accepted: go deep
    assert depth((0, 40)) < prior  # none was: a short path at most
    assert not [v for v, _ in corpus_candidates(corpus, ctx, root, 30, 4, ((0, 400),)) if v >= 0.25]
    # the session's own evidence, on top of the tenant's: its failures outweigh a tenant's few successes
    assert depth((4, 4), (0, 40)) < prior < depth((4, 4))


def test_a_short_match_drafts_less_than_a_long_one_until_the_evidence_says_otherwise():
    assert corpus_confidence(3) == 0.6 and corpus_confidence(3) < corpus_confidence(4) < corpus_confidence(20)
    # a tenant whose corpus nodes were accepted 30 times out of 30: a 3-token match is nearly as good
    assert corpus_confidence(3, (30, 30)) > 0.95
    # one whose nodes never were: even a long match is worth little, a short one less
    assert corpus_confidence(3, (0, 30)) < corpus_confidence(20, (0, 30)) < 0.25
    # the evidence is read broadest first, each level the prior of the next
    q = corpus_confidence(5, (3, 6))
    assert corpus_confidence(5, (3, 6), (2, 2)) == pytest.approx((2 + 4 * q) / (2 + 4))


def test_evidence_counts_the_corpus_nodes_the_target_was_asked_about():
    """A corpus node counts as tried when its parent was accepted (the target then chose between
    it and the rest), as accepted when it was; the nodes under a rejected one are no evidence. The
    session and the tenant's corpus both keep it."""
    corpus = Corpus(CorpusConfig(max_tokens=1000))
    answer = list(range(20, 40))
    corpus.add([1, 2, 3, *answer])
    s = DraftSession(DrafterConfig(window=4))
    s.corpus = corpus
    s.extend([0, 1, 2])
    tree = s.draft(3, 16)
    chain = [0]  # the tree's path 3 20 21 22 ... (all corpus nodes)
    while True:
        kids = [i for i, p in enumerate(tree.parents) if p == chain[-1] and tree.tokens[i] == answer[len(chain) - 1]]
        if not kids:
            break
        chain.append(kids[0])
    assert len(chain) > 3 and set(chain[1:]) <= set(tree.corpus_nodes)
    s.count_accepted(chain[:3])  # 20 and 21 accepted, 22 rejected: 3 tried, 2 accepted
    assert s.corpus_evidence.pair() == corpus.evidence.pair() == (2, 3)
    s.count_accepted(chain)  # a tree is counted once
    assert s.corpus_evidence.pair() == (2, 3)
    s.draft(3, 16)
    s.count_accepted([0])  # the root's corpus child rejected: tried once, nothing accepted
    assert s.corpus_evidence.pair() == corpus.evidence.pair() == (2, 4)
    # a new session of the tenant starts from the tenant's evidence (its own is empty)
    other = DraftSession(DrafterConfig(window=4))
    other.corpus = corpus
    assert other.corpus_evidence.pair() == (0, 0)


def test_the_sessions_own_streaming_response_does_not_hide_an_earlier_answer():
    """The session's response streams into the corpus as it is generated: its tail is the longest
    match of its own context, with nothing after it yet, and must not shadow an earlier answer."""
    corpus = Corpus(CorpusConfig(max_tokens=1000))
    corpus.add([50, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # an earlier answer of the tenant
    s = DraftSession(DrafterConfig(window=4))
    s.corpus = corpus
    prompt, mine = [70, 71], [60, 61, 62, 1, 2, 3, 4]
    corpus.append(corpus.writer(), mine)  # this turn's response so far, root (4) included
    s.extend(prompt + mine[:-1])
    assert corpus.match(s.history, 4) == (4, [4]), "the earlier answer's 1 2 3 4, not the session's own tail"
    tree = s.draft(4, 16)
    # 4/6, x 5/7, x 6/8, x 7/9 >= 0.25 (each accepted token lengthens the match), x 8/10 < 0.25
    assert [tree.tokens[i] for i in tree.corpus_nodes] == [5, 6, 7, 8]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=12),
    st.lists(st.integers(0, 4), max_size=12),
    st.integers(0, 4),
    st.sampled_from([0, 1, 5, 63]),
    st.sampled_from([(), ((10, 12),), ((0, 40),), ((60, 60),), ((60, 60), (0, 12))]),
    st.sampled_from([0.1, 0.25, 0.5]),
)
def test_candidates_cut_at_min_prob_are_the_ones_worth_it_in_the_same_order(
    responses, ctx, root, depth, observed, min_prob
):
    """Reading the continuations only as deep as ``min_prob`` allows, and keeping only the paths
    worth it, drops nothing ``add_corpus`` would have taken: the same paths, values and order."""
    corpus = Corpus(CorpusConfig(max_tokens=200))
    for r in responses:
        corpus.add(r)
    every = corpus_candidates(corpus, ctx, root, depth, 1, observed)
    assert corpus_candidates(corpus, ctx, root, depth, 1, observed, min_prob) == [c for c in every if c[0] >= min_prob]


# -- the corpus against the session's own nodes -----------------------------------------------------
def _session_with_strong_nodes(corpus):
    """Retrieval gives 4 after the root 3 (certain: "2 3" was always followed by 4), the copy-logit
    tree 5 after it (rank 0: 0.45), then 6, 7, ... (0.45 ** 2, ...)."""
    s = DraftSession(DrafterConfig(window=3))
    s.corpus = corpus
    ctx = [1, 2, 3, 4, 5, 6, 7, 2]
    s.extend(ctx, [[t + 1] for t in ctx])
    return s


def _tree(s, budget):
    t = s.draft(3, budget)
    return t.tokens, t.parents


def test_a_weak_short_corpus_match_never_displaces_a_stronger_session_node():
    """Two earlier answers agree with the context on 4 tokens and then disagree: each corpus path is
    worth 1/2 x 4/6 = 0.33 >= corpus_min_prob, less than the session's 0.45 node it would push out."""
    weak = Corpus(CorpusConfig(max_tokens=1000))
    weak.add([9, 6, 7, 2, 3, 30, 31])
    weak.add([9, 6, 7, 2, 3, 40, 41])
    assert {p for v, p in corpus_candidates(weak, [1, 2, 3, 4, 5, 6, 7, 2], 3, 2, 4) if v >= 0.25} == {(30,), (40,)}
    plain = _session_with_strong_nodes(None)
    with_weak = _session_with_strong_nodes(weak)
    assert _tree(with_weak, 3) == _tree(plain, 3) == ((3, 4, 5), (-1, 0, 1))
    assert not with_weak.draft(3, 3).corpus_nodes
    # worth more than the session's long shots (0.2, 0.09 a node), they take those places only
    tree = with_weak.draft(3, 5)
    assert sorted(tree.tokens) == [3, 4, 5, 30, 40] and len(tree.corpus_nodes) == 2


def test_a_long_repeated_match_puts_the_corpus_chain_in_place_of_the_sessions_weaker_nodes():
    strong = Corpus(CorpusConfig(max_tokens=1000))
    strong.add([1, 2, 3, 4, 5, 6, 7, 2, 3, 60, 61, 62, 63, 64])  # a 9-token match: 9/11 a token
    s = _session_with_strong_nodes(strong)
    tree = s.draft(3, 5)
    # 60, 61, 62 are worth 0.82, 0.67, 0.55 > the session's 0.45, 0.2, 0.09; retrieval's 4 stays
    assert (tree.tokens, tree.parents) == ((3, 4, 60, 61, 62), (-1, 0, 0, 2, 3))
    assert [tree.tokens[i] for i in tree.corpus_nodes] == [60, 61, 62]


def _candidate_set(raw):
    """Prefix-closed corpus paths with values that never grow along a path."""
    vals: dict[tuple, float] = {}
    for path, v in raw:
        for d in range(1, len(path) + 1):
            p = path[:d]
            vals[p] = min(vals.get(p[:-1], 1.0), max(vals.get(p, 0.0), v))
    for p in sorted(vals, key=len):  # a parent's value is never below its child's
        vals[p] = min(vals[p], vals.get(p[:-1], 1.0))
    return [(v, p) for p, v in vals.items()]


def _paths_values(trie):
    """(path after the root) -> value of every node but the root."""
    paths = [()]
    out = {}
    for i in range(1, len(trie.tokens)):
        paths.append(paths[trie.parents[i]] + (trie.tokens[i],))
        out[paths[i]] = trie.value[i]
    return out, paths


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.integers(0, 5), st.lists(st.integers(0, 5), unique=True, max_size=6), max_size=6),
    st.integers(1, 30),
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=3),
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 5), min_size=1, max_size=5).map(tuple),
            st.sampled_from([0.9, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05, 0.01]),
        ),
        max_size=8,
    ),
    st.sampled_from([0.0, 0.05, 0.25]),
)
def test_merge_corpus_against_the_session_tree(table, budget, pre, raw, min_prob):
    """Retrieval-like nodes (``pre``: never displaced), then the copy-logit tree and random corpus
    candidates compete: the merged tree keeps every ``pre`` node, holds only session and candidate
    paths, displaces only session nodes worth less than every corpus node it takes, is worth at
    least the session tree (sum of values), is the session tree exactly when the corpus adds
    nothing, and leaves out no candidate worth more than a session leaf it could have displaced."""
    from drafter.tree import add_logits, merge_corpus

    get = lambda t: tuple(table.get(t, ()))  # noqa: E731
    base = _Trie(0, budget)
    for path in pre:
        node = 0
        for t in path:
            node = base.add(node, t, 1.0)
            if node < 0:
                break
        if node < 0:
            break
    keep = {p for p in _paths_values(base)[0]}
    alone = base.copy()
    add_logits(alone, get, 4)
    merged = base.copy()
    cands = _candidate_set(raw)
    merge_corpus(merged, cands, lambda trie: add_logits(trie, get, 4), min_prob)
    tree = merged.flatten(0)
    check_tree_shape(tree, 0, budget)
    mine, _ = _paths_values(alone)
    got, node_paths = _paths_values(merged)
    worth = {p: v for v, p in cands if v >= min_prob}
    assert keep <= set(got)
    assert set(got) <= set(mine) | set(worth)
    corpus_paths = {node_paths[i] for i in merged.corpus}
    assert corpus_paths == set(got) - set(mine)
    if not corpus_paths:
        assert (merged.tokens, merged.parents) == (alone.tokens, alone.parents)
        return
    displaced = set(mine) - set(got)
    assert max((mine[p] for p in displaced), default=-1.0) < min(worth[p] for p in corpus_paths)
    value = lambda ps: sum(max(mine.get(p, 0.0), worth.get(p, 0.0)) for p in ps)  # noqa: E731
    assert value(got) >= value(mine) - 1e-9
    if len(got) + 1 >= budget:
        leaves = {p for p in got if p in mine and p not in keep and p not in worth}
        leaves -= {p[:-1] for p in got}
        for p, v in worth.items():
            if p not in got and (len(p) == 1 or p[:-1] in got) and leaves:
                assert v <= min(mine[q] for q in leaves), f"{p} ({v}) left out for a weaker session leaf"
