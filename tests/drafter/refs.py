"""Brute-force references and invariant checkers shared by the drafter property tests.

Everything here is written against the plain token list, not the drafter's data structures, so a
test compares two independent computations. The walks over the automaton are bounded and never
follow a recycled id blindly: a corrupted automaton must fail an assertion, not hang the suite.
"""

from __future__ import annotations

from collections import Counter, deque

from drafter.automaton import ROOT, Automaton
from drafter.tree import DraftTree


# -- context (token list) references -------------------------------------------------------------
def substring_counts(ctx, window: int) -> Counter:
    """Every substring of length 1..window of ``ctx`` -> number of occurrences."""
    out: Counter = Counter()
    n = len(ctx)
    for i in range(n):
        for L in range(1, window + 1):
            if i + L > n:
                break
            out[tuple(ctx[i : i + L])] += 1
    return out


def occurs(ctx, pattern) -> bool:
    """Whether ``pattern`` is a contiguous substring of ``ctx`` (the empty pattern always is)."""
    pattern = tuple(pattern)
    m = len(pattern)
    if m == 0:
        return True
    ctx = tuple(ctx)
    return any(ctx[i : i + m] == pattern for i in range(len(ctx) - m + 1))


def suffix(ctx, L: int) -> tuple:
    return tuple(ctx[len(ctx) - L :]) if L > 0 else ()


# -- automaton inspection ------------------------------------------------------------------------
def live_nodes(a: Automaton) -> list[int]:
    free = set(a._free)
    assert len(free) == len(a._free), "free list holds a node twice"
    assert ROOT not in free, "root is on the free list"
    return [v for v in range(len(a.children)) if v not in free]


def safe_string(a: Automaton, v: int) -> tuple:
    """``a.string(v)`` for a live node, asserting the parent chain is sane (live, bounded, consistent)."""
    free = set(a._free)
    out = []
    node = v
    for _ in range(a.window + 1):
        if node == ROOT:
            return tuple(reversed(out))
        assert 0 < node < len(a.children), f"node {v}: parent chain leaves the node arrays at {node}"
        assert node not in free, f"node {v}: parent chain passes through freed node {node}"
        out.append(a.token[node])
        node = a.parent[node]
    raise AssertionError(f"node {v}: parent chain longer than window {a.window} (cycle or corruption)")


def trie_strings(a: Automaton) -> dict[tuple, int]:
    """string -> node id over the live non-root nodes (asserting strings are unique)."""
    out: dict[tuple, int] = {}
    for v in live_nodes(a):
        if v == ROOT:
            continue
        s = safe_string(a, v)
        assert s not in out, f"two live nodes {out[s]} and {v} spell {s}"
        out[s] = v
    return out


def check_automaton(a: Automaton, ctx) -> dict[tuple, int]:
    """All structural invariants of the automaton after consuming ``ctx``. Returns string -> node."""
    ctx = list(ctx)
    n = a.window
    assert a.length == len(ctx)
    # capacity
    assert len(a) <= a.max_nodes, f"{len(a)} live nodes > max_nodes {a.max_nodes}"
    live = live_nodes(a)
    assert len(live) == len(a), "len() disagrees with the live node set"
    free = set(a._free)
    strings = trie_strings(a)
    subs = substring_counts(ctx, n)
    for s, v in strings.items():
        # every trie string is a real substring of the context of length 1..window
        assert 1 <= len(s) <= n, f"node {v} spells {s}, longer than window {n}"
        assert s in subs, f"node {v} spells {s}, which never occurs in the context"
        assert a.depth[v] == len(s), f"depth[{v}]={a.depth[v]} but it spells {s}"
        assert 1 <= a.freq[v] <= subs[s], f"freq[{s}]={a.freq[v]} not in 1..{subs[s]} occurrences"
        # prefix-closed: parent live and links back
        p = a.parent[v]
        assert p == ROOT or p not in free, f"node {s} has freed parent {p}"
        assert a.children[p].get(a.token[v]) == v, f"parent of {s} does not list it as a child"
        # suffix-closed with an exact failure link
        f = a.fail[v]
        assert f not in free and 0 <= f < len(a.children), f"fail of {s} is freed/invalid node {f}"
        if len(s) == 1:
            assert f == ROOT, f"fail of {s} is {f}, expected the root"
        else:
            assert s[1:] in strings, f"trie holds {s} but not its suffix {s[1:]}"
            assert f == strings[s[1:]], f"fail of {s} is node {f}, expected node of {s[1:]}"
    # children dicts of live nodes only point at live nodes with matching token and parent
    for v in live:
        for tok, ch in a.children[v].items():
            assert ch not in free, f"node {v} lists freed child {ch}"
            assert a.parent[ch] == v and a.token[ch] == tok, f"child link {v}-{tok}->{ch} inconsistent"
    # freed slots hold no children and are not anyone's child
    for v in free:
        assert not a.children[v], f"freed node {v} still has children"
    # frontier: node of the last L tokens, L = 0 .. min(len, window); state = the last one
    assert len(a.frontier) == min(len(ctx), n) + 1, "frontier has the wrong length"
    assert a.frontier[0] == ROOT
    for L, node in enumerate(a.frontier):
        assert node == ROOT or node not in free, f"frontier[{L}] = {node} is freed"
        got = safe_string(a, node) if node != ROOT else ()
        assert got == suffix(ctx, L), f"frontier[{L}] spells {got}, expected last {L} tokens {suffix(ctx, L)}"
    # match state = longest suffix (length <= window) present in the trie, brute force
    best = ()
    for L in range(1, min(len(ctx), n) + 1):
        if suffix(ctx, L) in strings:
            best = suffix(ctx, L)
    st = a.state
    assert (safe_string(a, st) if st != ROOT else ()) == best, "match state is not the longest present suffix"
    return strings


def freq_map(a: Automaton) -> dict[tuple, int]:
    return {s: a.freq[v] for s, v in trie_strings(a).items()}


# -- draft trees ---------------------------------------------------------------------------------
def check_tree_shape(tree: DraftTree, root: int, budget: int) -> None:
    toks, par = tree.tokens, tree.parents
    assert len(toks) == len(par) >= 1
    assert len(tree) == len(toks)
    assert toks[0] == root, "first token is not the root"
    assert par[0] == -1
    assert len(toks) <= budget, f"{len(toks)} nodes > budget {budget}"
    depth = [0]
    seen = set()
    for i in range(1, len(toks)):
        assert 0 <= par[i] < i, f"parents[{i}]={par[i]} not in [0, {i})"
        depth.append(depth[par[i]] + 1)
        assert depth[i] >= depth[i - 1], "not flattened breadth-first (depth decreases)"
        key = (par[i], toks[i])
        assert key not in seen, f"two siblings with token {toks[i]} under node {par[i]}"
        seen.add(key)
    assert 0 <= tree.n_retrieval <= len(toks) - 1


def tree_paths(tree: DraftTree) -> list[tuple]:
    """Root-to-node token paths *after* the root, one per non-root node, in node order."""
    paths: list[tuple] = [()]
    for i in range(1, len(tree.tokens)):
        paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
    return paths[1:]


def tree_children(tree: DraftTree) -> list[list[int]]:
    ch: list[list[int]] = [[] for _ in tree.tokens]
    for i in range(1, len(tree.tokens)):
        ch[tree.parents[i]].append(i)
    return ch


def retrieval_paths_reference(ctx, root: int, window: int, min_depth: int) -> set[tuple]:
    """Every continuation ``p`` (non-empty) such that suffix+root+p occurs in ``ctx`` for some context
    suffix of length L >= min_depth-1 with L+1+len(p) <= window (the automaton's depth limit)."""
    ctx = tuple(ctx)
    out: set[tuple] = set()
    for L in range(max(min_depth - 1, 0), min(len(ctx), window) + 1):
        head = suffix(ctx, L) + (root,)
        m = len(head)
        for i in range(len(ctx) - m + 1):
            if ctx[i : i + m] != head:
                continue
            for k in range(1, window - m + 1):
                if i + m + k > len(ctx):
                    break
                out.add(ctx[i + m : i + m + k])
    return out


def pld_reference(history, root: int, ngram: int, budget: int) -> tuple:
    """Prompt lookup, brute force: the chain after the most recent earlier occurrence of the longest
    n-gram (n <= ngram) made of the last n-1 history tokens and ``root``; () if none."""
    hist = tuple(history)
    H = len(hist)
    for n in range(min(ngram, H + 1), 0, -1):
        pat = suffix(hist, n - 1) + (root,)
        # occurrence ending at e (hist[e-n+1 .. e] == pat) with at least one token after it
        for e in range(H - 2, n - 2, -1):
            if hist[e - n + 1 : e + 1] == pat:
                return hist[e + 1 : e + budget]
    return ()


def logits_reference(table: dict, root: int, root_breadth: int, budget: int) -> list[tuple]:
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


def rank_value(table_get, root: int, path, rank_prob) -> float:
    """Best-first logits value of ``path`` (after the root): the product of the rank probabilities
    of each token in its parent's row, multiplied in path order (as the implementation does)."""
    v = 1.0
    tok = root
    for t in path:
        row = tuple(table_get(tok))[: len(rank_prob)]
        assert t in row, f"token {t} is not among the first {len(rank_prob)} successors {row} of {tok}"
        v = v * rank_prob[row.index(t)]
        tok = t
    return v


def table_consistent(table_get, root: int, path, width: int) -> bool:
    tok = root
    for t in path:
        if t not in tuple(table_get(tok))[:width]:
            return False
        tok = t
    return True


def best_first_frontier(table_get, root: int, drafted: set, width: int) -> set:
    """Children (by the table, first ``width`` of each row) of the table-consistent drafted nodes
    and of the root that are not drafted."""
    out = set()
    for p in drafted | {()}:
        if not table_consistent(table_get, root, p, width):
            continue
        tok = p[-1] if p else root
        for t in tuple(table_get(tok))[:width]:
            if p + (t,) not in drafted:
                out.add(p + (t,))
    return out
