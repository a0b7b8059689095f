"""Session records in the session store (Redis in a deployment): what lets any gateway serve any turn."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field

from common.errors import Abort, Status

from . import metrics as M
from .auth import SESSION_ID

log = logging.getLogger("racer.gateway")


@dataclass
class Record:
    session_id: str
    tenant: str
    history: list[int] = field(default_factory=list)
    turns: int = 0
    verifier: str = ""
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes) -> "Record":
        return cls(**json.loads(data))


def record_key(tenant: str, session_id: str) -> str:
    return f"racer:session:{tenant}:{session_id}"


class Records:
    """The records of every tenant in one store; store calls are retried for ``retry_s`` seconds."""

    def __init__(self, store, ttl_s: float, retry_s: float):
        self.store = store
        self.ttl_s = ttl_s
        self.retry_s = retry_s

    async def call(self, op: str, fn, *args, retry: bool = True):
        """A session-store call, retried with backoff for ``retry_s`` seconds (a Redis restart)."""
        deadline = time.monotonic() + (self.retry_s if retry else 0.0)
        delay = 0.05
        while True:
            try:
                return await fn(*args)
            except Exception as e:  # noqa: BLE001 - any store error is retried, then reported
                M.STORE_FAILURES.labels(op).inc()
                if time.monotonic() + delay > deadline:
                    log.warning("session store call failed", extra={"op": op, "error": repr(e)})
                    raise Abort(Status.UNAVAILABLE, f"session store unavailable ({op}): {e!r}") from None
                log.info("session store call failed; retrying", extra={"op": op, "error": repr(e)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def load(self, tenant: str, session_id: str) -> Record:
        if not SESSION_ID.fullmatch(session_id):
            raise Abort(
                Status.INVALID_ARGUMENT,
                f"session_id: {session_id[:40]!r}{'...' if len(session_id) > 40 else ''} is not a session id "
                "(1-128 of A-Z a-z 0-9 _ -)",
            )
        data = await self.call("get", self.store.get, record_key(tenant, session_id))
        if data is None:
            raise Abort(Status.NOT_FOUND, f"session_id {session_id!r}: no such session")
        rec = Record.loads(data)
        if rec.tenant != tenant:  # store keys are per tenant; this is a second lock on the door
            raise Abort(Status.NOT_FOUND, f"session_id {session_id!r}: no such session")
        return rec

    async def save(self, rec: Record) -> None:
        await self.call("set", self.store.set, record_key(rec.tenant, rec.session_id), rec.dumps(), self.ttl_s)

    async def delete(self, rec: Record) -> None:
        await self.call("delete", self.store.delete, record_key(rec.tenant, rec.session_id))

    async def all(self, tenant: str) -> list[Record]:
        """The tenant's records, in store order; not retried (a listing can be asked again)."""
        out = []
        for k in await self.call("keys", self.store.keys, record_key(tenant, ""), retry=False):
            data = await self.call("get", self.store.get, k, retry=False)
            if data is not None:
                rec = Record.loads(data)
                if rec.tenant == tenant:
                    out.append(rec)
        return out
