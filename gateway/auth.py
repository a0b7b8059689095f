"""Who is calling: API keys to tenants, and the shapes of the names that end up in store keys.

Keys are held as SHA-256 digests only: a memory dump or a traceback of the gateway shows no key.
The key file is read again on SIGHUP and when it changes (``ApiKeys.maybe_reload``, polled), so a
key is added, rotated or revoked without a restart; a file that no longer parses keeps the keys
already loaded (and says so in the log) rather than lock everyone out.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
from typing import Iterable

from common.errors import Abort, Status

log = logging.getLogger("racer.gateway")

LOCAL_TENANT = "local"  # every caller's tenant when auth is off
# Server-generated ids are 24 url-safe characters (144 random bits); anything else is refused
# before it reaches a store key.
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
TENANT = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def load_api_keys(path: str) -> dict[str, str]:
    """A file of ``key tenant`` lines (``#`` comments). A file without keys lets nobody in."""
    with open(path) as f:
        return parse_api_keys(f.read(), path)


def parse_api_keys(text: str, path: str) -> dict[str, str]:
    """``key tenant`` lines (``#`` comments) of the file at ``path`` (named in errors)."""
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
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


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys of one ``key tenant`` file, as digests; ``tenant(key)`` is the key's tenant or None."""

    def __init__(self, path: str):
        self.path = path
        self._digests: tuple[tuple[bytes, str], ...] = ()
        self._stamp: tuple | None = None
        self.reload(strict=True)

    def tenant(self, key: str) -> str | None:
        d = _digest(key)
        found = None
        for digest, tenant in self._digests:  # every digest compared: the time tells nothing of which matched
            if hmac.compare_digest(d, digest):
                found = tenant
        return found

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)  # follows the symlink a mounted Secret swaps on update
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload(self, strict: bool = False) -> bool:
        """Reads the file again; True when the keys changed. A file that cannot be read or parsed
        keeps the keys already loaded (``strict``, at start: raises). So does, on a reload, a file
        that looks half written: empty, or without a newline after its last line (a truncated
        ``key tenant-eu`` line could otherwise read as ``key tenant``), or one that changed while
        it was read (read again at the next poll)."""
        stamp = self._stat()
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            if not strict:
                if self._stat() != stamp:
                    return False  # being written: the next poll reads it whole
                if not raw.strip():
                    raise ValueError("the file is empty (to let nobody in, leave a comment line)")
                if not raw.endswith(b"\n"):
                    raise ValueError("no newline after the last line: the file may be half written")
            keys = parse_api_keys(raw.decode(), self.path)
        except (OSError, ValueError) as e:
            if strict:
                raise
            self._stamp = stamp  # logged once per change of the file, not at every poll
            log.error("API key file not reloaded; the keys loaded before stay in use", extra={"error": str(e)})
            return False
        digests = tuple((_digest(k), t) for k, t in keys.items())
        changed = digests != self._digests
        self._digests, self._stamp = digests, stamp
        if changed and not strict:
            log.info("API keys reloaded", extra={"keys": len(digests), "tenants": len(set(keys.values()))})
        return changed

    def maybe_reload(self) -> bool:
        """Reloads when the file changed since the last read."""
        return self._stat() != self._stamp and self.reload()

    async def watch(self, every: float) -> None:
        """Until cancelled: every ``every`` seconds, reloads the keys if the file changed (a rotated
        Secret is read again without a restart)."""
        while True:
            await asyncio.sleep(every)
            self.maybe_reload()


def tenant_of(api_keys: ApiKeys | None, metadata: Iterable[tuple[str, str]] | None) -> str:
    """The tenant of a call's ``metadata`` (``(key, value)`` pairs). ``api_keys`` None: auth is off."""
    if api_keys is None:  # auth explicitly off (local use)
        return LOCAL_TENANT
    md = {k.lower(): v for k, v in (metadata or ())}
    key = md.get("x-api-key", "")
    auth = md.get("authorization", "")
    if auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    tenant = api_keys.tenant(key) if key else None
    if tenant is None:
        raise Abort(Status.UNAUTHENTICATED, "missing or unknown API key (metadata 'authorization: Bearer <key>')")
    return tenant
