"""One writer per session across gateway replicas: a turn holds a lease on its session in the store.

The lease is a random token under ``racer:lease:<tenant>:<session>`` with a TTL, taken with an
atomic set-if-absent when the turn starts (a second turn of the session, on any gateway, gets
ABORTED), renewed every third of its TTL while the turn runs, and released when it ends. The turn's
record is saved with ``Records.save(rec, lease)``: a compare-and-set fenced by the lease, so a turn
whose lease expired (its gateway froze) or was broken by ``CloseSession`` on any gateway cannot
overwrite a newer record or bring a closed session back. A turn that loses its lease is ended with
ABORTED at its next round. The lease also counts the turn in the tenant's quotas (``quotas``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from common.errors import Abort, Status

from . import metrics as M
from .records import record_key

log = logging.getLogger("racer.gateway")


def lease_key(tenant: str, session_id: str) -> str:
    return f"racer:lease:{tenant}:{session_id}"


class Lease:
    def __init__(self, records, quotas, tenant: str, session_id: str, ttl_s: float):
        self.records = records
        self.quotas = quotas
        self.tenant = tenant
        self.session_id = session_id
        self.key = lease_key(tenant, session_id)
        self.token = secrets.token_urlsafe(18)
        self.ttl_s = ttl_s
        self.lost: str | None = None  # why the lease was lost, once it was
        self._renewing: asyncio.Task | None = None

    async def take(self, need: int, new: bool, kept: bool = True) -> None:
        """Takes the lease, then the turn's place in the quotas (``need``: tokens the session may grow
        to; ``kept`` False: a one-call session, which never counts as a kept session); ABORTED if
        another turn holds the session, RESOURCE_EXHAUSTED if a quota is full."""
        store = self.records.store
        if not await self.records.call("lease", store.acquire, self.key, self.token, self.ttl_s):
            raise Abort(
                Status.ABORTED, f"session_id {self.session_id!r}: a turn is already running", field="session_id"
            )
        try:
            record = record_key(self.tenant, self.session_id)
            await self.quotas.admit(self.tenant, self.session_id, need, self.token, self.ttl_s, new, record, kept)
        except BaseException:
            await self._release()
            raise
        self.new = new
        self.kept = kept
        self.need = need

    def keep(self, on_lost) -> None:
        """Renews the lease until ``end``; ``on_lost(reason)`` when it cannot."""
        self._ended = asyncio.Event()
        self._renewing = asyncio.create_task(self._renew(on_lost))

    async def _renew(self, on_lost) -> None:
        store = self.records.store
        loop = asyncio.get_running_loop()
        held_until = loop.time() + self.ttl_s
        while True:
            # Stopped by an event, not only by cancelling: a cancel that lands inside a Redis call can
            # be absorbed by the client library, and the loop would go on renewing a finished turn.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ended.wait(), self.ttl_s / 3)
            if self._ended.is_set():
                return
            t = loop.time()
            try:
                ok = await self.records.call("lease", store.renew, self.key, self.token, self.ttl_s, retry=False)
            except Abort:  # the store is down: the lease may still hold; try again until it surely does not
                if loop.time() < held_until:
                    continue
                ok = False
            if not ok:
                self.lost = (
                    f"session_id {self.session_id!r}: the session was closed, or its lease expired, while this turn "
                    "ran; the turn was not saved"
                )
                log.info("session lease lost", extra={"session_id": self.session_id})
                M.LEASE_LOST.inc()
                on_lost(self.lost)
                return
            held_until = t + self.ttl_s
            if self._ended.is_set():
                return
            with contextlib.suppress(Abort):
                await self.quotas.renew(self.tenant, self.session_id, self.token, self.ttl_s)

    async def end(self, saved_tokens: int | None, kept_tokens: int) -> None:
        """The turn ended: stops renewing, releases the lease and settles the quotas (``saved_tokens``:
        the saved record's length, None if the turn was not saved; then the session is back to
        ``kept_tokens``, or stops counting if it was new)."""
        if self._renewing is not None:
            self._ended.set()
            await asyncio.gather(self._renewing, return_exceptions=True)  # a renewal in flight: one store call
        outcome = "saved" if saved_tokens is not None else ("new" if self.new else "kept")
        if not self.kept:
            outcome = "call"
        tokens = saved_tokens if saved_tokens is not None else kept_tokens
        try:
            await self.quotas.end(self.tenant, self.session_id, self.token, outcome, tokens, self.need)
        except Abort as e:  # counted again correctly when the turn's entry and the session expire
            log.warning("quota update failed", extra={"session_id": self.session_id, "error": e.message})
        finally:
            await self._release()

    async def _release(self) -> None:
        try:
            await self.records.call("lease", self.records.store.release, self.key, self.token)
        except Abort as e:  # it expires on its own
            log.warning("lease release failed", extra={"session_id": self.session_id, "error": e.message})


async def break_lease(records, tenant: str, session_id: str) -> None:
    """``CloseSession``: whoever holds the session's lease loses it (its save will fail)."""
    await records.call("delete", records.store.delete, lease_key(tenant, session_id))
