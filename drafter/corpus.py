"""A tenant's corpus: its earlier responses, indexed for longest-suffix matching with frequencies.

Every session of a tenant drafts from the tenant's corpus beside its own automaton. The corpus has to
hold a million tokens in a few tens of megabytes and answer a lookup in well under a millisecond, so
it is a handful of flat numpy arrays instead of a trie of Python objects (a dict-of-dicts trie holds
``window`` nodes per token, hundreds of bytes each).

Layout: a ring of ``capacity`` token slots. Positions are absolute and only grow (slot = position %
capacity); a position is live while it is one of the last ``capacity`` written (``position >=
start``). Per slot:

- ``tok``: the token;
- ``back`` / ``fwd``: the positions of the previous and next token *of the same response* (-1: none).
  Responses streamed at the same time interleave in the ring, chunk by chunk; the links keep each one
  a contiguous string;
- ``chain``: the previous position whose key falls in the same hash bucket.

``head[bucket]`` is the newest position whose key (the ``key_len`` tokens of its response ending at
it) hashes to ``bucket``. A lookup walks that bucket's chain, newest first, checks the key (buckets
collide), then extends the match backwards along ``back`` against the session's context. The
candidates with the longest match give the continuations, read forwards along ``fwd``, and how many
candidates agree on each continuation is its frequency. An occurrence with nothing after it (the end
of a response, such as the session's own, still streaming) is no candidate.

Eviction is by age: writing past the capacity drops the oldest tokens, which are the oldest
responses' (a response keeps its newest part while its oldest tokens go). A dead position is never
read: every walk stops at ``start``, and a slot is rewritten only once its position is dead.

Pure and single-threaded: no I/O, no clocks, no locks (the drafter appends and looks up from its
event loop only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of key * golden ratio * 2**64
_M64 = (1 << 64) - 1
_BASE = 1 << 20  # > any vocabulary in use (Gemma's 256k included); keys of up to 3 tokens fold exactly into 60 bits
TOKEN_LIMIT = _BASE  # token ids a corpus takes: [0, TOKEN_LIMIT)


@dataclass(frozen=True)
class CorpusConfig:
    max_tokens: int = 1 << 20  # the bound per tenant (the ring's capacity)
    key_len: int = 3  # tokens of the indexed key (the root and the context tokens before it)
    max_match: int = 32  # longest match measured, in tokens (root included)
    max_scan: int = 64  # chain positions examined per lookup (newest first)
    max_candidates: int = 16  # continuations read per lookup, from the longest matches

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"corpus max_tokens={self.max_tokens}: must be >= 1")
        if not 1 <= self.key_len <= 3:
            raise ValueError(f"corpus key_len={self.key_len}: expected 1..3")
        if self.max_match < self.key_len or self.max_scan < 1 or self.max_candidates < 1:
            raise ValueError("corpus: max_match >= key_len, max_scan >= 1 and max_candidates >= 1")


class Evidence:
    """How the corpus nodes a drafter placed fared: ``tried``, the places where the target was asked
    about one (a corpus node's parent was on the accepted path: one per such parent, however many
    corpus children it had), and ``accepted``, the corpus nodes it accepted. A node whose parent was
    rejected was never asked about and is no evidence either way. Kept by each session and, pooled
    over a tenant's sessions on this replica, by the tenant's corpus (``Corpus.evidence``)."""

    __slots__ = ("accepted", "tried")

    def __init__(self):
        self.accepted = 0
        self.tried = 0

    def add(self, accepted: int, tried: int) -> None:
        self.accepted += accepted
        self.tried += tried

    def pair(self) -> tuple[int, int]:
        return self.accepted, self.tried


class Writer:
    """One response being added: where it ends so far, and its last tokens (for the next keys)."""

    __slots__ = ("last", "tail")

    def __init__(self):
        self.last = -1  # position of the response's last token; -1 before the first
        self.tail: list[int] = []  # its last key_len - 1 tokens


class Corpus:
    def __init__(self, config: CorpusConfig = CorpusConfig(), initial: int = 4096):
        self.config = config
        self.capacity = config.max_tokens
        # The arrays grow (doubling, index rebuilt) until they hold the capacity: a small tenant's
        # corpus stays small. Until then no position has wrapped, so slot = position holds too.
        self._alloc(min(self.capacity, max(1, initial)))
        self.total = 0  # positions ever written
        self.responses = 0
        # How the drafts from this corpus fared in the tenant's sessions on this replica (in memory
        # only: a corpus loaded again, or erased, starts from the prior; see ``tree.corpus_confidence``).
        self.evidence = Evidence()

    def _alloc(self, size: int) -> None:
        self.size = size
        self.tok = np.full(size, -1, dtype=np.int32)
        self.back = np.full(size, -1, dtype=np.int64)
        self.fwd = np.full(size, -1, dtype=np.int64)
        self.chain = np.full(size, -1, dtype=np.int64)
        self.bits = max(4, (2 * size - 1).bit_length())  # buckets: a power of two >= 2 x size
        self.head = np.full(1 << self.bits, -1, dtype=np.int64)

    def _grow(self, need: int) -> None:
        """Room for ``need`` positions (at most the capacity): copies the arrays, re-indexes."""
        old = (self.tok, self.back, self.fwd)
        n = self.total
        self._alloc(min(self.capacity, max(need, 2 * self.size)))
        for a, b in zip((self.tok, self.back, self.fwd), old):
            a[:n] = b[:n]
        k = self.config.key_len
        pos = np.arange(n, dtype=np.int64)
        ok = np.ones(n, dtype=bool)
        x = self.tok[:n].astype(np.uint64)
        q = pos
        for i in range(1, k):  # the key's earlier tokens, along the back links
            q = np.where(ok, self.back[np.maximum(q, 0)], -1)
            ok &= q >= 0
            x = x + np.uint64(_BASE**i) * self.tok[np.maximum(q, 0)].astype(np.uint64)
        self._index(pos[ok], x[ok])

    def __len__(self) -> int:
        """Live tokens."""
        return min(self.total, self.capacity)

    @property
    def start(self) -> int:
        """The oldest live position."""
        return max(0, self.total - self.capacity)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.tok, self.back, self.fwd, self.chain, self.head))

    # -- writing ------------------------------------------------------------------------------
    def writer(self) -> Writer:
        """A new response; its tokens go in with ``append`` as they are generated."""
        self.responses += 1
        return Writer()

    def add(self, tokens) -> None:
        """A whole response at once."""
        self.append(self.writer(), tokens)

    def append(self, w: Writer, tokens) -> None:
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if toks.size == 0:
            return
        if toks.min() < 0 or toks.max() >= _BASE:
            raise ValueError(f"corpus tokens must be in [0, {_BASE})")
        cap, k = self.capacity, self.config.key_len
        ext = np.concatenate([np.asarray(w.tail, dtype=np.int64), toks])  # the key's tokens before the chunk too
        if toks.size > cap:  # only the newest capacity tokens can stay
            toks = toks[-cap:]
            w.last = -1
        n = toks.size
        p0 = self.total
        if p0 + n > self.size and self.size < cap:
            self._grow(p0 + n)
        self.total += n
        if w.last < self.start:
            w.last = -1  # the response's earlier part has been evicted (by this chunk or before)
        pos = np.arange(p0, p0 + n, dtype=np.int64)
        slots = pos % cap
        self.tok[slots] = toks
        back = pos - 1
        back[0] = w.last
        self.back[slots] = back
        fwd = pos + 1
        fwd[-1] = -1
        self.fwd[slots] = fwd
        if w.last >= 0:
            self.fwd[w.last % cap] = p0
        # Keys: the k tokens ending at each new position, where the response has that many.
        off = ext.size - n  # index in ext of the chunk's first kept token
        j = np.arange(off, ext.size)
        ok = j >= k - 1
        j, kp = j[ok], pos[ok]
        x = np.zeros(kp.size, dtype=np.uint64)
        for i in range(k - 1, -1, -1):
            x = x * np.uint64(_BASE) + ext[j - i].astype(np.uint64)
        self._index(kp, x)
        w.last = p0 + n - 1
        w.tail = ext[ext.size - (k - 1) :].tolist() if k > 1 else []

    def _index(self, kp, x) -> None:
        """Puts positions ``kp`` (ascending) with folded keys ``x`` at the head of their buckets' chains."""
        if kp.size == 0:
            return
        cap = self.capacity
        h = ((x * np.uint64(_GOLDEN)) >> np.uint64(64 - self.bits)).astype(np.int64)  # wraps as _hash does
        order = np.argsort(h, kind="stable")  # by bucket, oldest first within one
        hs, ps = h[order], kp[order]
        new_bucket = np.r_[True, hs[1:] != hs[:-1]]
        prev = np.r_[np.int64(-1), ps[:-1]]
        prev[new_bucket] = self.head[hs[new_bucket]]
        self.chain[ps % cap] = prev
        last_in_bucket = np.r_[hs[1:] != hs[:-1], True]
        self.head[hs[last_in_bucket]] = ps[last_in_bucket]

    # -- reading ------------------------------------------------------------------------------
    def _hash(self, key) -> int:
        x = 0
        for t in key:
            x = x * _BASE + t
        return ((x * _GOLDEN) & _M64) >> (64 - self.bits)

    def match(self, context, root: int) -> tuple[int, list[int]]:
        """(L, positions): the longest match of (context + root) in the corpus, L tokens with the
        root, and the positions of the root's occurrences that have it, newest first. (0, []) when
        the last ``key_len`` tokens do not occur (or the context is shorter than the key).

        Only occurrences that something follows count. A session's own response streams into the
        corpus as it is generated, so its tail is always the longest match of its context, with
        nothing after it: counted, it would hide every other response's continuation."""
        cfg = self.config
        k = cfg.key_len
        if self.total == 0 or len(context) < k - 1:
            return 0, []
        key = [*context[len(context) - (k - 1) :], root] if k > 1 else [root]
        tok, back, fwd, chain = self.tok, self.back, self.fwd, self.chain
        cap, start = self.capacity, self.start
        n_ctx = len(context)
        best, found = 0, []
        p = int(self.head[self._hash(key)])
        scanned = 0
        while p >= start and scanned < cfg.max_scan:
            scanned += 1
            slot = p % cap
            if fwd[slot] < 0:  # nothing follows it (yet): no draft, and it must not hide a shorter match that has one
                p = int(chain[slot])
                continue
            # the key, backwards from p (the bucket may hold other keys)
            q, i, ok = p, k - 1, True
            while i >= 0:
                if q < start or tok[q % cap] != key[i]:
                    ok = False
                    break
                q = int(back[q % cap])
                i -= 1
            if ok:
                length = k
                j = n_ctx - k  # the context token before the key
                while length < cfg.max_match and j >= 0 and q >= start and tok[q % cap] == context[j]:
                    length += 1
                    j -= 1
                    q = int(back[q % cap])
                if length > best:
                    best, found = length, [p]
                elif length == best:
                    found.append(p)
            p = int(chain[slot])
        return best, found

    def continuation(self, p: int, depth: int) -> list[int]:
        """Up to ``depth`` tokens of the response that follow position ``p`` (live)."""
        out = []
        q = int(self.fwd[p % self.capacity])
        tok, fwd, cap = self.tok, self.fwd, self.capacity
        while q >= 0 and len(out) < depth:
            out.append(int(tok[q % cap]))
            q = int(fwd[q % cap])
        return out

    def continuations(self, positions: list[int], depth: int) -> list[list[int]]:
        """What followed a match's ``positions`` (the first ``max_candidates``; each up to ``depth`` tokens)."""
        return [self.continuation(p, depth) for p in positions[: self.config.max_candidates]]

    def lookup(self, context, root: int, depth: int) -> tuple[int, list[list[int]]]:
        """(L, continuations): the longest match, and what followed it (up to ``max_candidates`` of
        its occurrences, newest first; each up to ``depth`` tokens)."""
        length, positions = self.match(context, root)
        return length, self.continuations(positions, depth)
