"""The drafter's tenant corpora: one ``Corpus`` per tenant that shares, made at its first session,
dropped when the tenant has been idle, erased on request.

A tenant's sessions all draft from its corpus and add to it (unless a turn opts out); no session
ever sees another tenant's corpus: the map is keyed by the tenant the gateway vouched for.

No grpc, no clocks of its own: ``now`` is passed in, so tests move time by hand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from . import metrics as M
from .corpus import Corpus, CorpusConfig, Writer


@dataclass
class TenantCorpus:
    corpus: Corpus
    used: float  # when a session of the tenant last opened or streamed


class Corpora:
    def __init__(self, max_tokens: int = 1 << 20, idle_s: float = 600.0):
        self.max_tokens = max_tokens  # the default bound per tenant; 0: no corpus at all
        self.idle_s = idle_s
        self.tenants: dict[str, TenantCorpus] = {}

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def get(self, tenant: str, max_tokens: int = 0, now: float | None = None) -> Corpus | None:
        """The tenant's corpus, made (empty) at its first session; ``max_tokens``: the tenant's own
        bound (0: the default). None when corpora are off here."""
        if not self.enabled:
            return None
        now = time.monotonic() if now is None else now
        tc = self.tenants.get(tenant)
        if tc is None:
            bound = max_tokens or self.max_tokens
            tc = self.tenants[tenant] = TenantCorpus(Corpus(CorpusConfig(max_tokens=bound)), now)
            M.CORPUS_TENANTS.set(len(self.tenants))
        tc.used = now
        return tc.corpus

    def append(self, tenant: str, writer: Writer, tokens, now: float | None = None) -> None:
        tc = self.tenants.get(tenant)
        if tc is None:  # erased or dropped while the stream ran: nothing more is added
            return
        t0 = time.perf_counter()
        tc.corpus.append(writer, tokens)
        M.CORPUS_INDEX_SECONDS.observe(time.perf_counter() - t0)
        tc.used = time.monotonic() if now is None else now
        M.CORPUS_TOKENS.labels(tenant).set(len(tc.corpus))

    def holds(self, tenant: str, corpus: Corpus) -> bool:
        """Whether ``corpus`` is still the tenant's (not erased or dropped since it was handed out)."""
        tc = self.tenants.get(tenant)
        return tc is not None and tc.corpus is corpus

    def erase(self, tenant: str) -> bool:
        """Forgets the tenant's corpus here; whether there was one."""
        tc = self.tenants.pop(tenant, None)
        self._forget(tenant)
        return tc is not None

    def expire(self, now: float | None = None, busy: set[str] = frozenset()) -> list[str]:
        """Drops the corpora of tenants idle longer than ``idle_s`` (never one in ``busy``)."""
        now = time.monotonic() if now is None else now
        gone = [t for t, tc in self.tenants.items() if now - tc.used > self.idle_s and t not in busy]
        for t in gone:
            del self.tenants[t]
            self._forget(t)
        return gone

    def _forget(self, tenant: str) -> None:
        try:
            M.CORPUS_TOKENS.remove(tenant)
        except KeyError:
            pass
        M.CORPUS_TENANTS.set(len(self.tenants))

    def nbytes(self) -> int:
        return sum(tc.corpus.nbytes() for tc in self.tenants.values())
