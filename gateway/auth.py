"""Who is calling: API keys to tenants, and the shapes of the names that end up in store keys."""

from __future__ import annotations

import re
from typing import Iterable

from common.errors import Abort, Status

LOCAL_TENANT = "local"  # every caller's tenant when auth is off
# Server-generated ids are 24 url-safe characters (144 random bits); anything else is refused
# before it reaches a store key.
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
TENANT = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def load_api_keys(path: str) -> dict[str, str]:
    """A file of ``key tenant`` lines (``#`` comments). A file without keys lets nobody in."""
    keys: dict[str, str] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'key tenant'")
            if not TENANT.fullmatch(parts[1]):
                raise ValueError(f"{path}:{n}: tenant {parts[1]!r}: expected 1-64 of A-Z a-z 0-9 _ . @ -")
            keys[parts[0]] = parts[1]
    return keys


def tenant_of(api_keys: dict[str, str] | None, metadata: Iterable[tuple[str, str]] | None) -> str:
    """The tenant of a call's ``metadata`` (``(key, value)`` pairs). ``api_keys`` None: auth is off."""
    if api_keys is None:  # auth explicitly off (local use)
        return LOCAL_TENANT
    md = {k.lower(): v for k, v in (metadata or ())}
    key = md.get("x-api-key", "")
    auth = md.get("authorization", "")
    if auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    tenant = api_keys.get(key) if key else None
    if tenant is None:
        raise Abort(Status.UNAUTHENTICATED, "missing or unknown API key (metadata 'authorization: Bearer <key>')")
    return tenant
