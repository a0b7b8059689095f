"""Aho-Corasick automaton over a session's token n-grams, bounded by LRU eviction of leaves.

The trie holds every substring of the context of length <= ``window`` (n). Appending a token ``c``
adds, for each current suffix ``s`` of length < n (the failure chain of the match state),
the node ``s + c``. The trie is therefore closed under prefixes *and* suffixes, which gives
every node an exact failure link: ``fail(s) = s[1:]``, the longest proper suffix present.

Recency. A node's recency key is the position of its most recent occurrence,
``(start, -length)``: later start is more recent, and of two substrings with the same start the
shorter is more recent. A prefix or suffix of a substring occurs wherever the substring does, with
a larger key, so every node is strictly more recent than its children and than the nodes whose
failure link points at it. Hence the least recently used node is always a leaf that no failure link
targets: evicting it keeps the trie prefix- and suffix-closed, never orphans a subtree and never
leaves a dangling failure link. (Touching an insert path root-first, as some implementations do,
breaks this: a parent ends up older than its child.)

Keys only grow, and a touch at step ``j`` always has start in ``(j - n, j]``, so nodes are kept in
buckets by start; the oldest bucket holds the victim (its longest member).
"""

from __future__ import annotations

from collections import OrderedDict

ROOT = 0


class Automaton:
    __slots__ = (
        "window",
        "max_nodes",
        "children",
        "parent",
        "token",
        "depth",
        "freq",
        "fail",
        "start",
        "_free",
        "_buckets",
        "frontier",
        "length",
    )

    def __init__(self, window: int = 10, max_nodes: int = 10_000):
        if window < 1:
            raise ValueError("window must be >= 1")
        # Frontier nodes of the last `window` steps must survive one step of evictions: at most
        # window*(window+1)/2 nodes have a start inside that span.
        if max_nodes < window * (window + 1) + 1:
            raise ValueError(f"max_nodes must be >= window*(window+1)+1 = {window * (window + 1) + 1}")
        self.window = window
        self.max_nodes = max_nodes  # root included
        self.children: list[dict[int, int]] = [{}]
        self.parent: list[int] = [-1]
        self.token: list[int] = [-1]
        self.depth: list[int] = [0]
        self.freq: list[int] = [0]
        self.fail: list[int] = [ROOT]
        self.start: list[int] = [-1]  # start position of the most recent occurrence
        self._free: list[int] = []
        self._buckets: OrderedDict[int, dict[int, int]] = OrderedDict()  # start -> {node: depth}
        # frontier[L] = node of the context's last L tokens (L = 0 .. min(length, window)).
        # frontier[-1] is the match state: the longest suffix of the context present in the trie.
        self.frontier: list[int] = [ROOT]
        self.length = 0  # tokens consumed

    # -- queries ---------------------------------------------------------------------------------
    @property
    def state(self) -> int:
        return self.frontier[-1]

    def __len__(self) -> int:
        """Live nodes, root included."""
        return len(self.children) - len(self._free)

    def string(self, node: int) -> tuple[int, ...]:
        out = []
        while node != ROOT:
            out.append(self.token[node])
            node = self.parent[node]
        return tuple(reversed(out))

    def find(self, tokens) -> int:
        """Node of ``tokens`` or -1."""
        node = ROOT
        for t in tokens:
            node = self.children[node].get(t, -1)
            if node < 0:
                return -1
        return node

    # -- updates ---------------------------------------------------------------------------------
    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(t)

    def append(self, c: int) -> None:
        """Consumes one context token: inserts every suffix ending at it, advances the match state."""
        pos = self.length
        n = self.window
        old = self.frontier
        top = min(len(old), n)  # suffixes of length 0 .. top-1 can be extended by c
        new = [ROOT]
        children = self.children
        for L in range(top):  # new node for string old[L] + c has length L + 1, starts at pos - L
            u = old[L]
            v = children[u].get(c)
            if v is None:
                v = self._new_node(u, c, fail=new[L])
            new.append(v)
            # Touch at once: a reached node must not stay old while later creations evict.
            self.freq[v] += 1
            self._touch(v, pos - L, L + 1)
        self.frontier = new
        self.length = pos + 1

    def _touch(self, v: int, s: int, length: int) -> None:
        old_s = self.start[v]
        if old_s == s:
            return
        buckets = self._buckets
        if old_s >= 0:
            b = buckets.get(old_s)
            if b is not None:
                b.pop(v, None)
        self.start[v] = s
        b = buckets.get(s)
        if b is None:
            b = buckets[s] = {}
        b[v] = length

    def _new_node(self, parent: int, c: int, fail: int) -> int:
        if len(self) >= self.max_nodes:
            self._evict_one()
        if self._free:
            v = self._free.pop()
            self.children[v] = {}
            self.parent[v] = parent
            self.token[v] = c
            self.depth[v] = self.depth[parent] + 1
            self.freq[v] = 0
            self.fail[v] = fail
            self.start[v] = -1
        else:
            v = len(self.children)
            self.children.append({})
            self.parent.append(parent)
            self.token.append(c)
            self.depth.append(self.depth[parent] + 1)
            self.freq.append(0)
            self.fail.append(fail)
            self.start.append(-1)
        self.children[parent][c] = v
        return v

    def _evict_one(self) -> None:
        buckets = self._buckets
        while True:
            s, members = next(iter(buckets.items()))
            if members:
                break
            del buckets[s]
        victim = max(members, key=members.__getitem__)  # longest = least recent within the bucket
        del members[victim]
        if not members:
            del buckets[s]
        # Invariant (see module doc): the victim is a leaf and no failure link points at it.
        assert not self.children[victim], "LRU victim has children"
        del self.children[self.parent[victim]][self.token[victim]]
        self.parent[victim] = -1
        self.start[victim] = -1
        self._free.append(victim)

    # -- snapshots -------------------------------------------------------------------------------
    def to_state(self) -> dict:
        return {
            "window": self.window,
            "max_nodes": self.max_nodes,
            "parent": list(self.parent),
            "token": list(self.token),
            "freq": list(self.freq),
            "fail": list(self.fail),
            "start": list(self.start),
            "free": list(self._free),
            "children": [list(ch.values()) for ch in self.children],  # keeps each node's child order
            "buckets": [(s, list(m)) for s, m in self._buckets.items()],  # members' depths are derived
            "frontier": list(self.frontier),
            "length": self.length,
        }

    @classmethod
    def from_state(cls, st: dict) -> "Automaton":
        """The automaton ``to_state`` described, after checking every invariant the updates rely on.

        ``st`` may come from an untrusted store: a bad state raises ``ValueError`` rather than build an
        automaton that loops, crashes or grows later. Each node is visited once (O(nodes + buckets)).
        """
        a = cls(st["window"], st["max_nodes"])
        parent, token, freq, fail, start = (list(map(int, st[k])) for k in ("parent", "token", "freq", "fail", "start"))
        n = len(parent)
        _need(1 <= n <= a.max_nodes, f"{n} nodes, capacity {a.max_nodes}")
        _need(
            len(token) == len(freq) == len(fail) == len(start) == len(st["children"]) == n, "node arrays differ in size"
        )
        _need(parent[ROOT] == -1 and fail[ROOT] == ROOT and start[ROOT] == -1, "root node")
        free = [int(v) for v in st["free"]]
        freed = set(free)
        _need(len(freed) == len(free) and all(0 < v < n for v in free), "free list: ids out of range or repeated")
        for v in free:
            _need(parent[v] == -1 and start[v] == -1 and not st["children"][v], f"free node {v} is still linked")
        length = int(st["length"])
        _need(length >= 0, "length")
        a.parent, a.token, a.freq, a.fail, a.start = parent, token, freq, fail, start
        a._free = free
        a.length = length
        live = a._link_children(st["children"], freed)
        _need(live == n - len(free), f"{n - len(free) - live} live nodes unreachable from the root")
        a._buckets = a._checked_buckets(st["buckets"], live - 1)
        a.frontier = a._checked_frontier(st["frontier"])
        return a

    def _link_children(self, listed: list, freed: set[int]) -> int:
        """Builds ``children`` and ``depth`` from each node's ``listed`` child ids, breadth-first from
        the root (every node is reached at most once, through its own parent), checking each node's
        token, failure link and recency on the way; the number of live nodes reached."""
        parent, token, freq, fail, start = self.parent, self.token, self.freq, self.fail, self.start
        n, length = len(parent), self.length
        depth = [-1] * n
        depth[ROOT] = 0
        children: list[dict[int, int]] = [{} for _ in range(n)]
        queue = [ROOT]  # ids are recycled, so a parent may have a larger id
        for u in queue:
            kids = children[u]
            du = depth[u] + 1
            for v in listed[u]:
                v = int(v)
                _need(0 < v < n and v not in freed, f"node {u}: child id {v} out of range")
                _need(depth[v] < 0, f"node {v} is reached twice (a cycle or a shared child)")
                _need(parent[v] == u, f"node {v}: parent {parent[v]}, listed as a child of {u}")
                t = token[v]
                _need(t >= 0 and t not in kids, f"node {v}: token {t} negative or repeated among siblings")
                _need(du <= self.window and freq[v] >= 0 and 0 <= start[v] < length, f"node {v}: depth, freq or start")
                # fail(s) = s[1:]: for s = p + t it is fail(p) + t, one level up (exact, no string walk)
                f = ROOT if du == 1 else children[fail[u]].get(t, -1) if 0 <= fail[u] < n else -1
                _need(fail[v] == f, f"node {v}: failure link {fail[v]}, expected {f}")
                # recency (module doc): a node is more recent than its children and its failure link's source
                _need(u == ROOT or start[u] >= start[v], f"node {v}: more recent than its parent")
                _need(f == ROOT or start[f] > start[v], f"node {v}: more recent than its failure link")
                depth[v] = du
                kids[t] = v
                queue.append(v)
        self.children = children
        self.depth = [max(d, 0) for d in depth]
        return len(queue)

    def _checked_buckets(self, listed: list, non_root: int) -> OrderedDict[int, dict[int, int]]:
        """The recency buckets from ``(start, members)`` pairs: in order, each live node once."""
        buckets: OrderedDict[int, dict[int, int]] = OrderedDict()
        seen = 0
        last = -1
        for s, members in listed:
            s = int(s)
            _need(last < s < self.length, f"bucket {s}: out of order or range")
            last = s
            b = buckets[s] = {}
            for v in members:
                v = int(v)
                ok = 0 < v < len(self.depth) and self.depth[v] > 0 and self.start[v] == s and v not in b
                _need(ok, f"bucket {s}: member {v}")
                b[v] = self.depth[v]
            seen += len(b)
        _need(seen == non_root, "buckets do not hold every live node once")
        return buckets

    def _checked_frontier(self, listed: list) -> list[int]:
        """The match state's suffix nodes by length: each the failure link's target of the next."""
        frontier = [int(v) for v in listed]
        _need(len(frontier) == min(self.length, self.window) + 1 and frontier[0] == ROOT, "frontier size")
        for L in range(1, len(frontier)):
            v = frontier[L]
            _need(
                0 < v < len(self.depth) and self.depth[v] == L and self.fail[v] == frontier[L - 1],
                f"frontier[{L}] = {v}",
            )
        return frontier


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"invalid automaton state: {what}")
