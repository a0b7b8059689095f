"""The session table every stateful service keeps: entries per (tenant, session id), one stream at
a time per session, idle expiry after a TTL, and the least recently used idle entry first when
room is needed. The drafter and the verifier each extend ``Entry`` with their own state.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, Iterator, TypeVar

from .errors import Abort, Status

Key = tuple[str, str]  # (tenant, session id)


@dataclass
class Entry:
    tenant: str
    session_id: str
    last_used: float = field(default_factory=time.monotonic)  # monotonic seconds
    streaming: bool = False  # one stream at a time per session

    @property
    def key(self) -> Key:
        return (self.tenant, self.session_id)

    def touch(self) -> None:
        self.last_used = time.monotonic()


E = TypeVar("E", bound=Entry)


class SessionTable(Generic[E]):
    def __init__(self, ttl: float):
        self.ttl = ttl  # seconds an idle entry is kept
        self._entries: dict[Key, E] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[E]:
        return iter(list(self._entries.values()))

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def get(self, key: Key) -> E | None:
        return self._entries.get(key)

    def put(self, entry: E) -> E:
        self._entries[entry.key] = entry
        return entry

    def pop(self, key: Key) -> E | None:
        return self._entries.pop(key, None)

    def claim(self, entry: E) -> None:
        """Marks ``entry`` as held by a stream: ABORTED when another stream holds it."""
        if entry.streaming:
            raise Abort(Status.ABORTED, f"session {entry.session_id}: another stream is open on it")
        entry.streaming = True
        entry.touch()

    def release(self, entry: E) -> None:
        entry.streaming = False
        entry.touch()

    def streaming(self) -> int:
        return sum(1 for e in self._entries.values() if e.streaming)

    def idle_lru(self, keep: Key | None = None) -> E | None:
        """The least recently used entry no stream holds (other than ``keep``), or None."""
        idle = [e for k, e in self._entries.items() if not e.streaming and k != keep]
        return min(idle, key=lambda e: e.last_used) if idle else None

    def expire(self) -> list[E]:
        """Drops and returns the entries idle for longer than the TTL."""
        now = time.monotonic()
        gone = [e for e in self._entries.values() if not e.streaming and now - e.last_used > self.ttl]
        for e in gone:
            del self._entries[e.key]
        return gone


class Holder:
    """A service core that keeps its sessions in ``self.sessions``."""

    sessions: SessionTable

    @property
    def ttl(self) -> float:
        """Seconds an idle session is kept."""
        return self.sessions.ttl

    @ttl.setter
    def ttl(self, seconds: float) -> None:
        self.sessions.ttl = seconds


async def janitor(expire: Callable[[], Awaitable[object]], every: float = 30.0) -> None:
    """Calls ``expire`` every ``every`` seconds until cancelled."""
    while True:
        await asyncio.sleep(every)
        await expire()
