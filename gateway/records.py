"""Session records in the session store (Redis in a deployment): what lets any gateway serve any turn.

A record read from the store is not trusted: ``Record.loads`` checks its JSON has exactly the
record's fields with their types, history tokens in the vocabulary, and the tenant and session id
of the key it was read from. A record that fails is corrupt: the session cannot be continued
(``DATA_LOSS``, naming the session and nothing of the record), it is left out of listings,
``CloseSession`` deletes it, and every such read is counted (``racer_session_records_corrupt_total``)
and logged at most every 10 s.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields

from common.errors import Abort, Status
from common.logs import Throttled

from . import metrics as M
from .auth import SESSION_ID
from .backoff import Backoff

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
    # The bytes this record was read from (None: not in the store yet): what a fenced save compares.
    stored: bytes | None = field(default=None, repr=False, compare=False)

    def dumps(self) -> bytes:
        d = asdict(self)
        del d["stored"]
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def loads(
        cls, data: bytes, tenant: str | None = None, session_id: str | None = None, vocab_size: int | None = None
    ) -> "Record":
        """The record in ``data``, checked (see the module doc); ``RecordError`` says what is wrong."""
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise RecordError(f"not JSON ({type(e).__name__})") from None
        if not isinstance(d, dict) or set(d) != _FIELDS:
            raise RecordError("not an object with exactly the record's fields")
        for k in ("session_id", "tenant", "verifier"):
            _need(type(d[k]) is str, k)
        _need(type(d["turns"]) is int and d["turns"] >= 0, "turns")
        for k in ("created", "last_used"):
            _need(type(d[k]) in (int, float) and math.isfinite(d[k]), k)
        h = d["history"]
        _need(type(h) is list and all(type(t) is int and t >= 0 for t in h), "history")
        _need(vocab_size is None or all(t < vocab_size for t in h), "history: token outside the vocabulary")
        _need(tenant is None or d["tenant"] == tenant, "tenant: not the key's")
        _need(session_id is None or d["session_id"] == session_id, "session_id: not the key's")
        return cls(**d, stored=bytes(data))


_FIELDS = frozenset(f.name for f in fields(Record)) - {"stored"}


class RecordError(ValueError):
    """Bytes in the store that are not a valid session record."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise RecordError(f"bad field {what}")


def record_key(tenant: str, session_id: str) -> str:
    return f"racer:session:{tenant}:{session_id}"


class Records:
    """The records of every tenant in one store; store calls are retried for ``retry_s`` seconds."""

    def __init__(self, store, ttl_s: float, retry_s: float, vocab_size: int | None = None):
        self.store = store
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.vocab_size = vocab_size
        self._warnings = Throttled(log)  # corrupt records: all counted, logged at most every 10 s
        self._full = Throttled(log)  # a full store refuses every write: counted, logged at most every 10 s

    def _decode(self, data: bytes, tenant: str, session_id: str) -> Record:
        try:
            return Record.loads(data, tenant, session_id, self.vocab_size)
        except RecordError as e:
            M.CORRUPT_RECORDS.inc()
            self._warnings.warning(
                "corrupt session record", key=record_key(tenant, session_id), error=str(e), bytes=len(data)
            )
            raise Abort(
                Status.DATA_LOSS,
                f"session_id {session_id!r}: the stored session is corrupt and cannot be continued; "
                "start a new session (CloseSession deletes this one)",
                field="session_id",
            ) from None

    async def call(self, op: str, fn, *args, retry: bool = True):
        """A session-store call, retried with backoff for ``retry_s`` seconds (a Redis restart)."""
        backoff = Backoff(time.monotonic() + (self.retry_s if retry else 0.0))
        while True:
            try:
                return await fn(*args)
            except Exception as e:  # noqa: BLE001 - any store error is retried, then reported
                M.STORE_FAILURES.labels(op).inc()
                if type(e).__name__ == "OutOfMemoryError" or str(e).startswith("OOM"):  # Redis full (noeviction)
                    self._full.warning("session store full", op=op, error=repr(e))
                    raise Abort(
                        Status.RESOURCE_EXHAUSTED, f"session store full ({op}): close sessions or retry later"
                    ) from None
                if backoff.over():
                    log.warning("session store call failed", extra={"op": op, "error": repr(e)})
                    raise Abort(Status.UNAVAILABLE, f"session store unavailable ({op}): {e!r}") from None
                log.info("session store call failed; retrying", extra={"op": op, "error": repr(e)})
                await backoff.sleep()

    async def load(self, tenant: str, session_id: str) -> Record:
        """The session's record; NOT_FOUND if there is none, DATA_LOSS if the stored one is corrupt."""
        if not SESSION_ID.fullmatch(session_id):
            raise Abort(
                Status.INVALID_ARGUMENT,
                f"session_id: {session_id[:40]!r}{'...' if len(session_id) > 40 else ''} is not a session id "
                "(1-128 of A-Z a-z 0-9 _ -)",
                field="session_id",
            )
        data = await self.call("get", self.store.get, record_key(tenant, session_id))
        if data is None:
            raise Abort(Status.NOT_FOUND, f"session_id {session_id!r}: no such session", field="session_id")
        return self._decode(data, tenant, session_id)  # checks the tenant too: a second lock on the door

    async def save(self, rec: Record, lease=None) -> None:
        """Writes the record; with the turn's ``lease`` (``leases.Lease``) only while the lease is still
        the turn's and the stored record is still the one the turn read: ABORTED otherwise (the session
        was closed, or another turn took it over after this one's lease expired)."""
        key, data = record_key(rec.tenant, rec.session_id), rec.dumps()
        if lease is None:
            await self.call("set", self.store.set, key, data, self.ttl_s)
            rec.stored = data
            return
        fenced = (lease.key, lease.token, key, rec.stored, data, self.ttl_s)
        # (a retried call whose first try was written but not answered finds its own bytes there)
        if (
            not await self.call("set", self.store.fenced_set, *fenced)
            and await self.call("get", self.store.get, key) != data
        ):
            raise Abort(
                Status.ABORTED,
                f"session_id {rec.session_id!r}: the session was closed, or taken over by another turn after this "
                "turn's lease expired, while this turn ran",
                field="session_id",
            )
        rec.stored = data

    async def delete(self, rec: Record) -> None:
        await self.call("delete", self.store.delete, record_key(rec.tenant, rec.session_id))

    async def all(self, tenant: str) -> list[Record]:
        """The tenant's valid records, in store order (corrupt ones are counted and left out); not
        retried (a listing can be asked again)."""
        out = []
        prefix = record_key(tenant, "")
        for k in await self.call("keys", self.store.keys, prefix, retry=False):
            data = await self.call("get", self.store.get, k, retry=False)
            if data is not None:
                try:
                    out.append(self._decode(data, tenant, k[len(prefix) :]))
                except Abort:
                    continue
        return out
