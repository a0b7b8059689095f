"""Session records in the session store (Redis in a deployment): what lets any gateway serve any turn.

A record read from the store is not trusted: ``Record.loads`` checks its JSON has exactly the
record's fields with their types (a pydantic model), history tokens in the vocabulary, and the
tenant and session id of the key it was read from. A record that fails is corrupt: the session cannot be continued
(``DATA_LOSS``, naming the session and nothing of the record), it is left out of listings,
``CloseSession`` deletes it, and every such read is counted (``racer_session_records_corrupt_total``)
and logged at most every 10 s.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from common.errors import Abort, Status
from common.logs import Throttled

from . import metrics as M
from .auth import SESSION_ID
from .backoff import Backoff

log = logging.getLogger("racer.gateway")


Token = Annotated[int, Field(ge=0)]
UnixSeconds = Annotated[float, Field(allow_inf_nan=False)]


class Record(BaseModel):
    """A session's record. Stored as JSON with exactly these fields, each of its type (strict: true
    is no integer, "2" no number), which ``loads`` checks."""

    model_config = ConfigDict(strict=True, extra="forbid")

    session_id: str
    tenant: str
    history: list[Token]  # every token of the session: prompts and answers of all its turns
    turns: Annotated[int, Field(ge=0)]
    verifier: str  # the session's verifier endpoint ("": none yet)
    created: UnixSeconds
    last_used: UnixSeconds
    # The bytes this record was read from (None: not in the store yet): what a fenced save compares.
    _stored: bytes | None = PrivateAttr(default=None)

    @classmethod
    def new(cls, session_id: str, tenant: str, at: float | None = None) -> Record:
        """A session without a turn yet, created ``at`` (unix seconds; now by default)."""
        at = time.time() if at is None else at
        return cls(session_id=session_id, tenant=tenant, history=[], turns=0, verifier="", created=at, last_used=at)

    @property
    def stored(self) -> bytes | None:
        return self._stored

    def dumps(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def loads(
        cls, data: bytes, tenant: str | None = None, session_id: str | None = None, vocab_size: int | None = None
    ) -> Record:
        """The record in ``data``, checked (see the module doc); ``RecordError`` says what is wrong."""
        try:
            rec = cls.model_validate_json(data)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            raise RecordError(f"{'.'.join(map(str, err['loc'])) or 'record'}: {err['msg']}") from None
        for name, want in (("tenant", tenant), ("session_id", session_id)):
            if want is not None and getattr(rec, name) != want:
                raise RecordError(f"{name}: not the key's")
        if vocab_size is not None and any(t >= vocab_size for t in rec.history):
            raise RecordError("history: token outside the vocabulary")
        rec._stored = bytes(data)
        return rec


class RecordError(ValueError):
    """Bytes in the store that are not a valid session record."""


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
            rec._stored = data
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
        rec._stored = data

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
