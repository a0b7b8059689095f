"""The prefix cache: KV rows of prompts' leading blocks, kept for later sessions of the same tenant.

Agents open every session with the same thousands of tokens (tool documentation, a system
prompt). A session's own KV cache already spares its later turns a prefill; this cache spares
a tenant's *other* sessions one: a new session copies the rows of the longest cached block prefix of
its prompt into its own preallocated cache (a memcpy of a few MB where a prefill takes seconds)
and prefills only the rest. Rows are copied, never shared: a session owns its cache as before, so
nothing a running session needs can be evicted from here, and a row's bits are the bits the
prompt's own prefill computed (the backend says where: ``Backend.prefix_exact``; in reduced
precision only the native decoder, whose rows are row-invariant, qualifies).

Blocks. Cached KV is identified by blocks of ``block`` tokens (64 by default), hashed as a chain
(``common/prefix.py``): block i's key is ``blake2b(key of block i-1, its tokens)``, block 0's
``blake2b(scope, its tokens)``.
A key thus names a whole prefix, and ``scope`` (the tenant, or the sharing group an operator put it
in: the gateway's decision, never the client's) is part of every key, so two tenants never share a
block, and a guessed prefix of another tenant's is never found (the timing side channel vLLM closed
with a salt). 64 tokens: a lookup of a 3,000-token prompt hashes 47 blocks and copies 47 slices;
a prompt loses at most 63 tokens of its cached prefix to the block boundary (2% of 3,000), and the
copies stay large enough to run at memory speed. vLLM uses 16-token blocks because its pages are
its attention's memory layout; here blocks are only the unit of lookup and eviction.

Eviction. Blocks are kept in LRU order. A lookup touches a chain leaf first, so a parent is always
more recent than its children and the eviction of the oldest block takes chain tails before their
heads (a head evicted first would strand its tail). Pinned blocks (a copy in flight into a session,
or rows being filled) are never evicted. The cache holds one reservation of KV memory
(``kv_memory.py``): it grows only into free memory, and its oldest blocks are evicted like idle
caches when a session needs room (``Verifier._evict``).

No torch, no grpc: a block's rows are whatever the backend gives (``read_rows``/``write_rows``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from common.prefix import chain_keys, key_id

BLOCK_TOKENS = 64


@dataclass(eq=False)
class Block:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    rows: object = None  # the block's KV rows (the backend's), None while they are being copied in
    scope: str = ""  # the scope it was cached under (its key's too): another verifier gets it only in that scope
    pins: int = 0  # copies in flight (into a session, or into this block): never evicted while > 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Match:
    """A lookup's result: ``blocks`` (pinned until ``PrefixCache.unpin``) cover ``tokens`` tokens."""

    blocks: list[Block]

    @property
    def tokens(self) -> int:
        return sum(len(b.tokens) for b in self.blocks)


class PrefixCache:
    """Blocks by key, in LRU order. ``block_bytes``: what one block's rows take (for accounting)."""

    def __init__(self, block_bytes: int, block: int = BLOCK_TOKENS):
        if block <= 0 or block_bytes <= 0:
            raise ValueError(f"prefix cache: blocks of {block} tokens, {block_bytes} bytes")
        self.block = block
        self.block_bytes = block_bytes
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # oldest first

    def scope_key(self, scope: str) -> str:
        """What separates caches: the scope itself (a tenant, or a sharing group)."""
        return scope

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    def keys(self, scope: str, tokens: list[int], n_blocks: int | None = None) -> list[bytes]:
        return chain_keys(self.scope_key(scope), tokens, self.block, n_blocks)

    def match(self, scope: str, tokens: list[int], limit: int) -> Match:
        """The longest chain of ready blocks that begins ``tokens`` and ends by ``limit`` tokens,
        pinned and touched (leaf first: parents stay more recent than their children)."""
        found = []
        for key, i in zip(self.keys(scope, tokens, limit // self.block), range(limit // self.block)):
            b = self.blocks.get(key)
            # the tokens are compared too: a key names them, but a collision must not hand out others' rows
            if b is None or b.rows is None or b.tokens != tuple(tokens[i * self.block : (i + 1) * self.block]):
                break
            found.append(b)
        self._touch(found)
        for b in found:
            b.pins += 1
        return Match(found)

    def match_any_scope(self, tokens: list[int], limit: int) -> Match:
        """``match`` by the tokens alone, whatever scope holds them: what a holder that ignored the
        scope would serve (the fault ``ignore-scope`` of ``prefix_fetch``; never used otherwise)."""
        found, parent = [], None
        for i in range(limit // self.block):
            want = tuple(tokens[i * self.block : (i + 1) * self.block])
            b = next(
                (b for b in self.blocks.values() if b.parent == parent and b.tokens == want and b.rows is not None),
                None,
            )
            if b is None:
                break
            found.append(b)
            parent = b.key
        for b in found:
            b.pins += 1
        return Match(found)

    def unpin(self, match: Match) -> None:
        for b in match.blocks:
            b.pins -= 1
        match.blocks = []

    def _touch(self, chain: list[Block]) -> None:
        now = time.monotonic()
        for b in reversed(chain):
            b.last_used = now
            self.blocks.move_to_end(b.key)

    def missing(self, scope: str, tokens: list[int]) -> tuple[list[bytes], int]:
        """(keys of ``tokens``' full blocks, index of the first one not cached): what an insert adds."""
        keys = self.keys(scope, tokens)
        first = next((i for i, k in enumerate(keys) if k not in self.blocks), len(keys))
        self._touch([self.blocks[k] for k in keys[:first]])
        return keys, first

    def add(self, keys: list[bytes], tokens: list[int], first: int, count: int, scope: str = "") -> list[Block]:
        """New blocks ``first .. first + count`` of ``tokens`` (keys from ``missing``) in ``scope``, pinned
        and without rows: the caller fills them (``fill``) or takes them back (``discard``)."""
        out = []
        for i in range(first, first + count):
            b = Block(keys[i], keys[i - 1] if i else None, tuple(tokens[i * self.block : (i + 1) * self.block]))
            b.scope = scope
            b.pins = 1
            self.blocks[b.key] = b
            out.append(b)
        self._touch(out)
        return out

    def put(self, key: bytes, parent: bytes | None, tokens, scope: str, rows) -> Block:
        """A ready block from elsewhere (a warm-up: its key checked by the caller), unpinned."""
        b = Block(key, parent, tuple(tokens), rows, scope)
        self.blocks[key] = b
        return b

    def touch(self, chain: list[Block]) -> None:
        """Marks ``chain`` (parents before children) used now, parents the more recent."""
        self._touch(chain)

    def fill(self, blocks: list[Block], rows: list[object]) -> None:
        for b, r in zip(blocks, rows):
            b.rows = r
            b.pins -= 1

    def discard(self, blocks: list[Block]) -> None:
        for b in blocks:
            if self.blocks.get(b.key) is b:
                del self.blocks[b.key]

    def oldest(self) -> Block | None:
        """The least recently used block no copy holds (the next to evict), or None."""
        return next((b for b in self.blocks.values() if b.pins == 0), None)

    def evict(self, b: Block) -> None:
        del self.blocks[b.key]

    def held(self) -> list[int]:
        """Every ready block's ``key_id`` (what gateways place sessions by), oldest first."""
        return [key_id(k) for k, b in self.blocks.items() if b.rows is not None]
