"""Stored responses (``store: true``) in the session store, beside the sessions they are points of.

One JSON value per response under ``racer:response:<tenant>:<id>``, written once when its turn has
ended, with the store's session TTL (``--session-ttl``) from then. The session's record is saved
with the same TTL at the same moment and again at every later turn, so a response never outlives
its session unless the session is closed. Keys are per tenant: another tenant's id is a key that
does not exist, answered as a missing one. What is read back is checked as session records are (a
strict pydantic model; the tenant and id of its key); a corrupt value is DATA_LOSS.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import Abort, Status

from .records import Records

RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9]{1,128}")


class StoredResponse(BaseModel):
    """A stored response: the session point it continues from and what it answered."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: str
    tenant: str
    session_id: str  # the session whose tokens hold the conversation up to this response
    end: Annotated[int, Field(ge=1)]  # the session's tokens through this response's output
    instructions: str | None  # the conversation's, rendered into its first tokens
    calls: dict[str, bool]  # the conversation's function calls: call id -> answered
    ids: list[str]  # ids of the conversation's items (what a continuation must not send again)
    input: list[dict]  # this response's input items, each with its id
    body: dict  # the response object as it was answered


def response_key(tenant: str, response_id: str) -> str:
    return f"racer:response:{tenant}:{response_id}"


class ResponseStore:
    """Stored responses in the gateway's session store (its retries and TTL: ``records``)."""

    def __init__(self, records: Records):
        self.records = records

    async def save(self, r: StoredResponse) -> None:
        rec = self.records
        await rec.call("set", rec.store.set, response_key(r.tenant, r.id), r.model_dump_json().encode(), rec.ttl_s)

    async def load(self, tenant: str, response_id: str, field: str | None = None) -> StoredResponse:
        """NOT_FOUND when there is no such response of this tenant (``field``: the request field that
        named it); DATA_LOSS when the stored value is corrupt."""
        if not RESPONSE_ID.fullmatch(response_id):
            raise missing(response_id, field)
        rec = self.records
        data = await rec.call("get", rec.store.get, response_key(tenant, response_id))
        if data is None:
            raise missing(response_id, field)
        try:
            r = StoredResponse.model_validate_json(data)
        except ValidationError:
            r = None
        if r is None or r.tenant != tenant or r.id != response_id:
            raise Abort(
                Status.DATA_LOSS, f"Response with id {response_id!r}: the stored response is corrupt", field=field
            )
        return r

    async def delete(self, tenant: str, response_id: str) -> bool:
        if not RESPONSE_ID.fullmatch(response_id):
            return False
        rec = self.records
        return bool(await rec.call("delete", rec.store.delete, response_key(tenant, response_id)))


def missing(response_id: str, field: str | None) -> Abort:
    shown = response_id if len(response_id) <= 80 else response_id[:77] + "..."
    return Abort(Status.NOT_FOUND, f"Response with id {shown!r} not found.", field=field)
