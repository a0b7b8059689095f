"""Prefix blocks' keys, computed alike by verifiers (their prefix cache) and gateways (placement).

A prompt's first ``block`` tokens, the next ``block`` tokens, ... are its blocks; block i's key is
``blake2b(key of block i-1, its tokens)`` and block 0's ``blake2b(scope, its tokens)``, so a key
names a whole prefix within one scope (a tenant, or an operator's sharing group of tenants).
Verifiers report the blocks they hold as ``key_id``s (the key's first 8 bytes) to every gateway.
"""

from __future__ import annotations

import hashlib
from array import array


def chain_keys(scope: str, tokens: list[int], block: int, n_blocks: int | None = None) -> list[bytes]:
    """The 16-byte keys of ``tokens``' first full blocks (all of them, or at most ``n_blocks``), in order."""
    n = len(tokens) // block if n_blocks is None else min(n_blocks, len(tokens) // block)
    keys, prev = [], None
    for i in range(n):
        prev = child_key(scope, prev, tokens[i * block : (i + 1) * block])
        keys.append(prev)
    return keys


def child_key(scope: str, parent: bytes | None, tokens) -> bytes:
    """The key of the block of ``tokens`` after the block keyed ``parent`` (None: a chain's first block)."""
    h = hashlib.blake2b(b"scope\x00" + scope.encode() if parent is None else parent, digest_size=16)
    h.update(array("i", list(tokens)).tobytes())
    return h.digest()


def key_id(key: bytes) -> int:
    """A block key as the 64-bit number verifiers report (an unsigned ``fixed64``)."""
    return int.from_bytes(key[:8], "little")


def group_scope(group: str) -> str:
    """The scope of an operator's sharing group: never a tenant's name (tenant names have no colon)."""
    return f"group:{group}"
