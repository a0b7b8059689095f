"""A verifier's session entry: the session table's entry with its KV cache and what the cache holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sessions import Entry as _Entry

from .engine import VerifierSession


@dataclass
class Entry(_Entry):
    session: VerifierSession = None  # type: ignore[assignment] - always given
    tokens: list[int] = field(default_factory=list)  # what the KV cache holds, in order
    reserved_rows: int = 0  # cache rows KV memory reserves for it
    scope: str = ""  # the prefix cache's scope of its last open: its tenant, or the tenant's sharing group
