"""Shared prompt prefixes: the drafting state of a tenant's common prompt start, built once per
replica and referenced by every session of the tenant that begins with it, never copied.

Agents open every session with the same system prompt (tool documentation: thousands of tokens).
Without sharing, each session builds an automaton over it (tens of ms on a 3,000-token prompt), holds
it (megabytes) and writes it into every snapshot (hundreds of KiB). A ``SharedPrefix`` holds, for a
block-aligned prompt start: its tokens, an automaton over them (frozen after the build), the
copy-logit rows of its positions and its prompt-lookup index. A session that begins with it keeps
only what comes after: its own automaton (seeded with the prefix's last ``window - 1`` tokens, so
n-grams across the boundary are kept), its own rows (looked up before the prefix's), and a
``PrefixView``, its match state over the prefix's automaton. Its snapshot names the prefix by length
and digest; a replica that restores it finds the prefix in memory or builds it from the history the
open carries (which must hash to the digest, else the snapshot is not used).

Which prefix: prompts are cut into blocks of ``BLOCK`` tokens, hashed as a chain with the tenant
(the digest of a block covers the tenant and every token before it), so different tenants never
share. A new session's first prompt is looked up block by block: the longest prefix already shared
is used; otherwise, if it shares at least ``min_tokens`` tokens (whole blocks) with an earlier new
session's prompt of the tenant, that common start becomes a shared prefix (built from the earlier
prompt's copy-logit rows: the target's top-k at a position depends only on the tokens up to it, so
they are the same). The first session of a tenant therefore drafts as before; the next ones share.
A prefix is always shorter than the prompt, so a session has at least one token of its own.

Memory: prefixes are held in LRU order up to ``max_prefixes``, and the candidates of as many tenants
(the last prompt's top-k rows as int32: ~100 KB for 3,000 tokens); a prefix that leaves the index
stays alive as long as a session references it (its bytes are counted once, while indexed).
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .automaton import ROOT, Automaton

BLOCK = 64  # tokens per hashed block: fine enough to find a system prompt's end, few hashes per prompt
DIGEST_BYTES = 16


def chain_digests(tenant: str, tokens, block: int = BLOCK) -> list[bytes]:
    """Digest of each whole block of ``tokens``, chained: the i-th covers the tenant and tokens[: (i+1)*block]."""
    h = hashlib.blake2b(tenant.encode(), digest_size=DIGEST_BYTES).digest()
    out = []
    for end in range(block, len(tokens) + 1, block):
        chunk = ",".join(map(str, tokens[end - block : end])).encode()
        h = hashlib.blake2b(h + chunk, digest_size=DIGEST_BYTES).digest()
        out.append(h)
    return out


def prefix_digest(tenant: str, tokens, block: int = BLOCK) -> bytes | None:
    """The chain digest of ``tokens`` (a whole number of blocks), None otherwise."""
    if not tokens or len(tokens) % block:
        return None
    return chain_digests(tenant, tokens, block)[-1]


@dataclass(eq=False)
class SharedPrefix:
    tenant: str
    digest: bytes
    tokens: tuple[int, ...]
    automaton: Automaton  # over ``tokens``; never changed after the build
    rows: dict[int, tuple[int, ...]]  # copy-logit rows of the prefix's positions (later positions win)
    ngram_last: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # prompt lookup
    nbytes: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


def build(tenant: str, tokens, window: int, topk: int, rows=None, pld_ngram: int = 3) -> SharedPrefix:
    """The shared state of ``tokens``; ``rows``: the target's top-k after each token (None: none known)."""
    tokens = tuple(tokens)
    digest = prefix_digest(tenant, tokens)
    if digest is None:
        raise ValueError(f"a shared prefix is whole blocks of {BLOCK} tokens, not {len(tokens)}")
    # room for every n-gram of the prefix: nothing of it is evicted while it is built
    auto = Automaton(window, max(window * len(tokens) + 1, window * (window + 1) + 1))
    auto.extend(tokens)
    table: dict[int, tuple[int, ...]] = {}
    if rows is not None:
        for t, row in zip(tokens, rows):
            table[t] = tuple(row[:topk])
    idx: dict[tuple[int, ...], tuple[int, int]] = {}
    for end in range(len(tokens)):
        for size in range(1, min(pld_ngram, end + 1) + 1):
            key = tokens[end - size + 1 : end + 1]
            idx[key] = (end, idx.get(key, (-1, -1))[0])
    p = SharedPrefix(tenant, digest, tokens, auto, table, idx)
    p.nbytes = _estimate(p)
    return p


def _estimate(p: SharedPrefix) -> int:
    a = p.automaton
    total = sum(sys.getsizeof(d) for d in a.children) + 28 * 6 * len(a.children)
    total += sum(sys.getsizeof(x) for x in (a.parent, a.token, a.depth, a.freq, a.fail, a.start))
    total += sys.getsizeof(p.rows) + sum(sys.getsizeof(r) for r in p.rows.values())
    total += sys.getsizeof(p.tokens) + sys.getsizeof(p.ngram_last) + 100 * len(p.ngram_last)
    return total


class PrefixView:
    """A session's match state over a shared prefix's automaton: what retrieval reads (``children``,
    ``parent``, ``depth``, ``freq``, ``frontier``), with a frontier of its own; the automaton is never
    written.

    ``frontier[L]`` is the node of the context's last ``L`` tokens, for L = 0 .. the longest such
    suffix the prefix holds (at most ``window``): since the trie is closed under suffixes, a suffix
    that is absent has no longer suffix present either."""

    __slots__ = ("prefix", "children", "parent", "depth", "freq", "window", "frontier")

    def __init__(self, prefix: SharedPrefix, context_tail):
        a = prefix.automaton
        self.prefix = prefix
        self.children, self.parent, self.depth, self.freq = a.children, a.parent, a.depth, a.freq
        self.window = a.window
        self.frontier = [ROOT]
        tail = list(context_tail)[-a.window :]
        for L in range(1, len(tail) + 1):  # the match state from the context's last tokens alone
            v = a.find(tail[len(tail) - L :])
            if v < 0:
                break
            self.frontier.append(v)

    def extend(self, tokens) -> None:
        children = self.children
        for c in tokens:
            old = self.frontier
            new = [ROOT]
            for L in range(min(len(old), self.window)):
                v = children[old[L]].get(c)
                if v is None:
                    break
                new.append(v)
            self.frontier = new


class _Candidates:
    """A tenant's recent new-session prompts, as chain digests, with the copy-logit rows of the last one."""

    def __init__(self):
        self.digests: OrderedDict[bytes, None] = OrderedDict()  # every block digest of recent prompts
        # the last prompt: its tokens, the top-k rows it came with ([rows, k] int32) and the position of rows[0]
        self.last: tuple[list[int], np.ndarray | None, int] = ([], None, 0)

    def nbytes(self) -> int:
        rows = self.last[1]
        return 8 * len(self.last[0]) + (rows.nbytes if rows is not None else 0) + 100 * len(self.digests)


class SharedPrefixes:
    """This replica's shared prefixes, per tenant, found or made at a new session's open."""

    def __init__(self, window: int, topk: int, min_tokens: int = 512, max_prefixes: int = 256, pld_ngram: int = 3):
        if min_tokens < 0:
            raise ValueError("min_tokens must be >= 0 (0: no sharing)")
        self.window, self.topk, self.pld_ngram = window, topk, pld_ngram
        self.min_tokens = -(-min_tokens // BLOCK) * BLOCK if min_tokens else 0
        self.max_prefixes = max_prefixes
        self._prefixes: OrderedDict[tuple[str, bytes], SharedPrefix] = OrderedDict()
        self._candidates: OrderedDict[str, _Candidates] = OrderedDict()
        self.built = 0  # prefixes built (from a second prompt, or for a restore)

    @property
    def enabled(self) -> bool:
        return self.min_tokens > 0

    def __len__(self) -> int:
        return len(self._prefixes)

    def nbytes(self) -> int:
        """The prefixes indexed and the candidates kept to find the next ones."""
        return sum(p.nbytes for p in self._prefixes.values()) + sum(c.nbytes() for c in self._candidates.values())

    def find(self, tenant: str, tokens) -> SharedPrefix | None:
        """The longest shared prefix of the tenant that ``tokens`` begins with (and outlasts)."""
        if not self.enabled or len(tokens) <= self.min_tokens:
            return None
        digests = chain_digests(tenant, tokens[: len(tokens) - 1])
        for i in range(len(digests) - 1, self.min_tokens // BLOCK - 2, -1):
            p = self._prefixes.get((tenant, digests[i]))
            if p is not None:
                self._prefixes.move_to_end((tenant, digests[i]))
                return p
        return None

    def for_new_session(self, tenant: str, tokens, rows) -> SharedPrefix | None:
        """The prefix a new session with prompt ``tokens`` should reference: one already shared, one made
        now from a common start with an earlier new session's prompt, or None (the prompt is then kept
        as a candidate). ``rows``: the target's top-k of the prompt's last ``len(rows)`` positions."""
        if not self.enabled or len(tokens) <= self.min_tokens:
            return None
        found = self.find(tenant, tokens)
        if found is not None:
            return found
        digests = chain_digests(tenant, tokens[: len(tokens) - 1])
        cand = self._candidates.get(tenant)
        if cand is None:
            cand = self._candidates[tenant] = _Candidates()
            while len(self._candidates) > self.max_prefixes:
                self._candidates.popitem(last=False)
        self._candidates.move_to_end(tenant)
        common = 0
        for i, d in enumerate(digests):
            if d not in cand.digests:
                break
            common = i + 1
        made = None
        if common * BLOCK >= self.min_tokens:
            n = common * BLOCK
            made = self._make(tenant, tokens[:n], self._rows_for(cand, tokens, rows, n))
        for d in digests:
            cand.digests[d] = None
            cand.digests.move_to_end(d)
        while len(cand.digests) > 8 * 1024:  # ~64 prompts of 8k tokens
            cand.digests.popitem(last=False)
        first_row = len(tokens) - len(rows)
        kept = np.asarray(rows, dtype=np.int32).reshape(len(rows), -1) if len(rows) else None
        cand.last = (list(tokens), kept, first_row)
        return made

    def _rows_for(self, cand: _Candidates, tokens, rows, n: int):
        """Top-k rows of positions 0..n-1 from this prompt's or the last candidate's (whichever covers
        them from position 0, which holds the same tokens there); None when neither does."""
        first_row = len(tokens) - len(rows)
        if first_row == 0:
            return rows[:n]
        ctoks, crows, cfirst = cand.last
        if crows is not None and cfirst == 0 and len(ctoks) >= n and ctoks[:n] == list(tokens[:n]):
            return crows[:n].tolist()
        return None

    def _make(self, tenant: str, tokens, rows) -> SharedPrefix:
        p = build(tenant, tokens, self.window, self.topk, rows, self.pld_ngram)
        self._add(p)
        return p

    def _add(self, p: SharedPrefix) -> None:
        self.built += 1
        self._prefixes[(p.tenant, p.digest)] = p
        while len(self._prefixes) > self.max_prefixes:
            self._prefixes.popitem(last=False)

    def resolve(self, tenant: str, length: int, digest: bytes, history) -> SharedPrefix | None:
        """The prefix a snapshot names, for a session whose history is ``history``: from memory, else
        built from the history (without copy-logit rows); None when the history does not begin with it."""
        if length <= 0 or len(history) <= length or prefix_digest(tenant, history[:length]) != digest:
            return None
        p = self._prefixes.get((tenant, digest))
        if p is not None:
            self._prefixes.move_to_end((tenant, digest))
            return p
        p = build(tenant, history[:length], self.window, self.topk, None, self.pld_ngram)
        self._add(p)
        return p

    def drop_tenant(self, tenant: str) -> None:
        for key in [k for k in self._prefixes if k[0] == tenant]:
            del self._prefixes[key]
        self._candidates.pop(tenant, None)
