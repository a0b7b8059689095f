"""Draft trees: retrieval paths from the automaton, copy-logit expansion, and their merge.

A draft tree is rooted at the token the target already chose (``root``). It is built as a trie
(shared prefixes merge, so every node counts once against the budget) and flattened breadth-first
into ``tokens[]`` and ``parents[]`` (``parents[0] == -1``, ``parents[i] < i``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .automaton import Automaton


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    n_retrieval: int = 0  # nodes (root excluded) that came from the automaton
    # Insertion order of each node (0 = root): retrieval best-first, then the logits tree. The
    # nodes ranked below C form the tree this drafter builds with budget C (see ``prefix``).
    ranks: tuple[int, ...] = ()
    corpus_nodes: tuple[int, ...] = ()  # nodes that came from the tenant corpus (first), ascending

    def __len__(self) -> int:
        return len(self.tokens)

    def with_path(self, path) -> "DraftTree":
        """This tree with ``path`` (tokens after the root) as one of its paths: the nodes it already
        has are followed, the rest appended (each after its parent, so ``parents[i] < i`` holds)."""
        tokens, parents = list(self.tokens), list(self.parents)
        child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents)) if p >= 0}
        node = 0
        for t in path:
            nxt = child.get((node, t))
            if nxt is None:
                nxt = len(tokens)
                tokens.append(t)
                parents.append(node)
                child[(node, t)] = nxt
            node = nxt
        extra = len(tokens) - len(self.tokens)
        ranks = self.ranks + tuple(range(len(self.tokens), len(tokens))) if self.ranks else ()
        return DraftTree(tuple(tokens), tuple(parents), self.n_retrieval, ranks, self.corpus_nodes) if extra else self

    def prefix(self, budget: int) -> "DraftTree":
        """The sub-tree of the ``budget`` first-inserted nodes (a parent is inserted before its children)."""
        if budget >= len(self.tokens):
            return self
        keep = [i for i, r in enumerate(self.ranks) if r < budget]
        new_of = {old: new for new, old in enumerate(keep)}
        return DraftTree(
            tuple(self.tokens[i] for i in keep),
            tuple(-1 if self.parents[i] < 0 else new_of[self.parents[i]] for i in keep),
            min(self.n_retrieval, budget - 1),
            tuple(self.ranks[i] for i in keep),
            tuple(new_of[i] for i in self.corpus_nodes if i in new_of),
        )


class _Trie:
    __slots__ = ("tokens", "parents", "depth", "index", "budget", "corpus", "value")

    def __init__(self, root: int, budget: int):
        self.tokens = [root]
        self.parents = [-1]
        self.depth = [0]
        self.index: dict[tuple[int, int], int] = {}
        self.budget = budget
        self.corpus: list[int] = []  # nodes first added by the tenant corpus
        # Each node's estimated chance that the target accepts the path to it (the root: 1), as
        # the source that added it (or the best of those that met it) estimated it.
        self.value = [1.0]

    def full(self) -> bool:
        return len(self.tokens) >= self.budget

    def add(self, parent: int, token: int, value: float = 0.0) -> int:
        """Returns the node for (parent, token), adding it if absent; -1 when the budget is spent.
        ``value``: the adder's estimate for the node (an existing node keeps the higher one)."""
        key = (parent, token)
        i = self.index.get(key)
        if i is not None:
            if value > self.value[i]:
                self.value[i] = value
            return i
        if len(self.tokens) >= self.budget:
            return -1
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.value.append(value)
        self.index[key] = i
        return i

    def copy(self) -> "_Trie":
        """The same nodes and budget in a trie of its own."""
        t = _Trie(self.tokens[0], self.budget)
        t.tokens, t.parents, t.depth, t.value = self.tokens[:], self.parents[:], self.depth[:], self.value[:]
        t.index, t.corpus = dict(self.index), self.corpus[:]
        return t

    def flatten(self, n_retrieval: int) -> DraftTree:
        order = sorted(range(len(self.tokens)), key=self.depth.__getitem__)  # stable: BFS
        if order == list(range(len(order))):
            return DraftTree(tuple(self.tokens), tuple(self.parents), n_retrieval, tuple(order), tuple(self.corpus))
        new_of = {old: new for new, old in enumerate(order)}
        return DraftTree(
            tuple(self.tokens[i] for i in order),
            tuple(-1 if self.parents[i] < 0 else new_of[self.parents[i]] for i in order),
            n_retrieval,
            tuple(order),
            tuple(sorted(new_of[i] for i in self.corpus)),
        )


def retrieval_borders(auto: Automaton, root: int, min_depth: int = 2) -> list[int]:
    """Automaton nodes for (suffix + root) over the match state's failure chain, longest first.

    The frontier of the automaton *is* the failure chain of the match state (fail(s) = s[1:]).
    """
    borders = []
    children = auto.children
    for node in reversed(auto.frontier):
        if auto.depth[node] + 1 < min_depth:
            break
        b = children[node].get(root)
        if b is not None:
            borders.append(b)
    return borders


def add_retrieval(
    trie: _Trie, auto: Automaton, root: int, min_depth: int = 2, min_prob: float = 0.0, backoff: float = 0.5
) -> int:
    """Adds the best retrieval continuations to ``trie``; returns the number of nodes added.

    Candidates are ranked best-first by an estimated probability of acceptance: the product along
    the path of freq(child) / freq(node) taken in the longest matching context (the deepest
    border whose sub-trie holds the path), ties broken by raw frequency.
    """
    borders = retrieval_borders(auto, root, min_depth)
    if not borders:
        return 0
    children, freq = auto.children, auto.freq
    # A draft node maps to the automaton nodes (one per border still matching), deepest first.
    heap: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    counter = 0

    def push(draft_parent: int, prob: float, autos: tuple[int, ...]) -> None:
        nonlocal counter
        # Children of every matching automaton node, grouped by token, deepest context first.
        seen: dict[int, list[int]] = {}
        for a in autos:
            for tok, ch in children[a].items():
                seen.setdefault(tok, []).append(ch)
        deepest = autos[0]
        for tok, chs in seen.items():
            top = chs[0]
            parent_auto = auto.parent[top]
            p = prob * freq[top] / max(freq[parent_auto], 1)
            if parent_auto != deepest:  # the longer context has seen other continuations only
                p *= backoff
            if p < min_prob:
                continue
            counter += 1
            heapq.heappush(heap, (-p, -freq[chs[-1]], counter, draft_parent, (tok, *chs)))

    push(0, 1.0, tuple(borders))
    added = 0
    while heap and not trie.full():
        negp, _, _, draft_parent, (tok, *chs) = heapq.heappop(heap)
        before = len(trie.tokens)
        node = trie.add(draft_parent, tok, -negp)
        if node < 0:
            break
        added += len(trie.tokens) - before
        push(node, -negp, tuple(chs))
    return added


# Acceptance rate of the i-th ranked copy-logit successor given its parent was accepted: a prior
# with a sharp head, as the copy-logit rank distribution is (Token Recycling, RACER fig. 3).
RANK_PRIOR = (0.45, 0.14, 0.07, 0.045, 0.03, 0.022, 0.017, 0.013)


def add_logits(trie: _Trie, table_get, root_breadth: int, rank_prob=RANK_PRIOR) -> None:
    """Breadth-first copy-logit expansion with breadth halving, until the budget is spent.

    ``table_get(token)`` returns ranked next-token ids. The root expands ``root_breadth`` children;
    a node's first child gets half its breadth, each next sibling half of the previous, never < 1.
    Nodes already in the trie (from retrieval) are shared, not paid for twice. A node's value is its
    parent's times the rank prior of its rank (the last one past the prior's end); it does not
    change the shape, only how the node competes with the corpus (``merge_corpus``).
    """
    queue = [(0, trie.tokens[0], root_breadth)]
    head = 0
    last = len(rank_prob) - 1
    add, value, tokens, budget = trie.add, trie.value, trie.tokens, trie.budget  # bound once: a round adds ~64
    while head < len(queue) and len(tokens) < budget:
        node, tok, breadth = queue[head]
        head += 1
        nxt = table_get(tok)
        if not nxt:
            continue
        child_breadth = breadth
        parent_value = value[node]  # adding a child changes only the child's value
        for rank, t in enumerate(nxt[:breadth]):
            child_breadth = child_breadth // 2 or 1
            child = add(node, t, parent_value * rank_prob[rank if rank < last else last])
            if child < 0:
                return
            queue.append((child, t, child_breadth))


def add_logits_best_first(trie: _Trie, table_get, rank_prob=RANK_PRIOR) -> None:
    """Copy-logit expansion that spends the budget on the most probable nodes first.

    A node's value is the product of its ancestors' rank probabilities, i.e. the chance that the
    target accepts the whole path; taking nodes best-first maximises the expected accepted length
    for the budget. Nodes already in the trie are expanded without being paid for.
    """
    heap: list[tuple[float, int, int, int]] = []
    counter = 0

    def push(node: int, prob: float) -> None:
        nonlocal counter
        for rank, t in enumerate(table_get(trie.tokens[node])[: len(rank_prob)]):
            counter += 1
            heapq.heappush(heap, (-prob * rank_prob[rank], counter, node, t))

    expanded = {0}
    push(0, 1.0)
    while heap and not trie.full():
        negp, _, parent, t = heapq.heappop(heap)
        before = len(trie.tokens)
        child = trie.add(parent, t, -negp)
        if child < 0:
            return
        if len(trie.tokens) > before or child not in expanded:
            expanded.add(child)
            push(child, -negp)


PRIOR_NODES = 4  # how many corpus nodes of evidence the match-length prior counts as


def corpus_confidence(match: int, *observed: tuple[int, int]) -> float:
    """The chance that the target accepts a corpus node whose parent continues a match of ``match``
    tokens (root included), given that parent was accepted: a prior ``match / (match + 2)``, worth
    ``PRIOR_NODES`` nodes, moved towards each ``(accepted, tried)`` of ``observed`` in turn
    (``corpus.Evidence``; the broadest first: the tenant's pooled evidence, then the session's
    own, each the prior of the next). With no evidence a short match is trusted less than a long one;
    a tenant whose corpus nodes keep being accepted soon drafts from 3-token matches as deep as from
    long ones, and one whose corpus nodes keep failing stops drafting from short matches first."""
    q = match / (match + 2)
    for accepted, tried in observed:
        q = (accepted + PRIOR_NODES * q) / (tried + PRIOR_NODES)
    return q


def corpus_candidates(
    corpus,
    context,
    root: int,
    depth: int,
    min_match: int = 3,
    observed: tuple[tuple[int, int], ...] = (),
    min_prob: float = 0.0,
) -> list[tuple[float, tuple[int, ...]]]:
    """Continuation paths from a tenant corpus, each with its estimated chance of acceptance.

    The longest match of (context + root), L tokens, gives the candidates; a path's value is the
    share of them that continue with it (its frequency) times the chance that the target accepts
    each of its tokens in turn, ``corpus_confidence`` (with ``observed``) of the match the token
    continues: L for the first, L + 1 for the second (its parent, accepted, lengthened the match),
    and so on. A long match of a repeated answer keeps a deep chain; a short, ambiguous or often
    wrong one a few nodes or none. Only the paths worth ``min_prob`` are returned (in the order they
    are first met): a path is never worth more than its confidence alone, so the continuations are
    read no deeper than that allows.
    """
    length, positions = corpus.match(context, root)
    if length < min_match or not positions:
        return []
    worth = [1.0]  # worth[d]: the chance that all of a path d tokens deep is accepted, frequency aside
    while len(worth) <= depth:
        w = worth[-1] * corpus_confidence(length + len(worth) - 1, *observed)
        if w < min_prob:
            break
        worth.append(w)
    reach = len(worth) - 1  # the deepest a path worth min_prob can be (its frequency is at most 1)
    if reach == 0:
        return []
    conts = corpus.continuations(positions, reach)
    # the continuations' prefix tree: node (its parent node, token) -> id; ids in first-met order
    ids: dict[tuple[int, int], int] = {}
    counts: list[int] = []
    for c in conts:
        node = -1
        for tok in c:
            key = (node, tok)
            node = ids.get(key, -1)
            if node < 0:
                node = ids[key] = len(counts)
                counts.append(0)
            counts[node] += 1
    n = len(conts)
    out, paths = [], {-1: ()}
    for (parent, tok), node in ids.items():  # parents before children: a parent is met first
        path = paths.get(parent)
        if path is None:  # the parent was worth too little, so is every path through it
            continue
        value = counts[node] / n * worth[len(path) + 1]
        if value >= min_prob:
            paths[node] = path = path + (tok,)
            out.append((value, path))
    return out


def add_corpus(trie: _Trie, candidates, min_prob: float = 0.25) -> int:
    """Adds corpus paths best-first into the trie's free places while their value is at least
    ``min_prob``; returns the nodes added (nodes already in the trie are free). A parent's value is
    never below its child's, so best-first order inserts a parent before its children."""
    return merge_corpus(trie, candidates, None, min_prob)


def merge_corpus(trie: _Trie, candidates, fill, min_prob: float = 0.25) -> int:
    """Adds the corpus paths worth more than the session nodes they would displace; returns the
    corpus nodes added.

    ``trie`` holds the nodes that are never displaced (the root and the session's retrieval);
    ``fill(trie)`` adds the session's own tree after them (the copy-logit tree, values set by
    ``add_logits``), or None. The rule: a tree's worth is the expected number of tokens the target
    accepts from it, the sum of its nodes' values (each the estimated chance that the path to it is
    accepted). The session's tree is built as it would be without the corpus; then the corpus
    candidates, best first, each take a place that is free, or else the place of the session's
    least valuable leaf, only if the candidate is worth strictly more than that leaf. A swap
    therefore never lowers the tree's estimated worth, an empty or weak corpus leaves the session's
    tree exactly as it was, and a long, confirmed match (values near 1 along the chain) pushes out
    the copy-logit tree's long shot nodes first. A corpus path through a session node shares it
    (that node stays the session's)."""
    session = trie.copy()
    if fill is not None:
        fill(session)
    keep = len(trie.tokens)
    new, removed = _compete(session, keep, candidates, min_prob)
    _rebuild(trie, session, keep, new, removed)
    return len(new)


def _compete(session: _Trie, keep: int, candidates, min_prob: float):
    """The corpus nodes that win a place in ``session`` (nodes from ``keep`` on may be displaced),
    as (parent, token, value) in best-first order (parent: a session node >= 0, or -1 - j for the
    j-th winner), and the session nodes they displace (leaves only, so what stays is a tree). A
    session node that a corpus path shares is worth the better of the two estimates."""
    ranked = [c for c in sorted(candidates, key=lambda c: (-c[0], len(c[1]))) if c[0] >= min_prob]
    value = session.value
    for v, path in ranked:  # the session nodes the corpus confirms
        node = 0
        for tok in path:
            node = session.index.get((node, tok), -1)
            if node < 0:
                break
        if node > 0 and v > value[node]:
            value[node] = v
    n = len(session.tokens)
    kids = [0] * n
    for i in range(1, n):
        kids[session.parents[i]] += 1
    leaves = [(value[i], -i) for i in range(keep, n) if kids[i] == 0]  # least valuable, latest first
    heapq.heapify(leaves)
    removed: set[int] = set()
    new: list[tuple[int, int, float]] = []
    ref_of: dict[tuple[int, ...], int] = {(): 0}
    size = n
    for v, path in ranked:
        parent = ref_of.get(path[:-1])
        if parent is None:
            continue
        mine = session.index.get((parent, path[-1]), -1) if parent >= 0 else -1
        if mine >= 0 and mine not in removed:
            ref_of[path] = mine
            continue
        if size >= session.budget:
            while leaves and kids[-leaves[0][1]]:  # a corpus node hangs under it now
                heapq.heappop(leaves)
            if not leaves or leaves[0][0] >= v:
                continue  # the session's least valuable node is worth at least as much
            _, neg = heapq.heappop(leaves)
            removed.add(-neg)
            up = session.parents[-neg]
            kids[up] -= 1
            if kids[up] == 0 and up >= keep:
                heapq.heappush(leaves, (value[up], -up))
            size -= 1
        if parent >= 0:
            kids[parent] += 1
        new.append((parent, path[-1], v))
        ref_of[path] = -len(new)
        size += 1
    return new, removed


def _rebuild(trie: _Trie, session: _Trie, keep: int, new, removed: set[int]) -> None:
    """Adds to ``trie`` (which holds ``session``'s first ``keep`` nodes) the corpus winners ``new``
    and the session nodes not ``removed``, in ``session``'s order: each winner as soon as its parent
    is in (best-first order among those waiting), so the nodes under the kept ones come first."""
    placed = {i: i for i in range(keep)}
    waiting = {ref for ref, _, _ in new}
    pending = list(range(len(new)))

    def hang() -> None:
        rest = []
        for j in pending:  # best-first order: a parent before its children
            ref, tok, v = new[j]
            if ref in placed:
                node = placed[-1 - j] = trie.add(placed[ref], tok, v)
                trie.corpus.append(node)
            else:
                rest.append(j)
        pending[:] = rest

    hang()
    for i in range(keep, len(session.tokens)):
        if i in removed:
            continue
        placed[i] = trie.add(placed[session.parents[i]], session.tokens[i], session.value[i])
        if pending and i in waiting:
            hang()
    if pending or min(placed.values()) < 0:  # the places are counted exactly: never
        raise RuntimeError("corpus merge: a node found no place in the budget")
