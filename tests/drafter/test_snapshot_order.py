"""A session's snapshot writes land in order: a write held up (a retry after Redis restarted) never
overwrites a newer snapshot of the session, and one with a newer write behind it is skipped."""

from __future__ import annotations

import asyncio

from common.store import MemoryStore
from drafter.core import Drafter, Open, Step, snapshot_key
from drafter.draft_session import DrafterConfig
from drafter.snapshot import loads


class HeldStore(MemoryStore):
    """The first ``set`` waits for ``release``; every value set is recorded in order."""

    def __init__(self):
        super().__init__()
        self.release, self.held, self.sets = asyncio.Event(), asyncio.Event(), []

    async def set(self, key, value, ttl):
        if not self.held.is_set():
            self.held.set()
            await self.release.wait()
        self.sets.append(value)
        await super().set(key, value, ttl)


CFG = DrafterConfig(window=4, max_nodes=64, topk=3)


def test_a_held_up_snapshot_write_never_lands_after_a_newer_one():
    async def go():
        store = HeldStore()
        d = Drafter(CFG, store)
        entry, _ = await d.open(Open("t", "s", [1, 2, 3, 4], []))
        d.release(entry)  # the first snapshot: its write is held
        await store.held.wait()
        for history in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8]):  # two newer snapshots queue behind it
            entry, _ = await d.open(Open("t", "s", history, []))
            d.step(entry, Step([], [], 0, history[-1], 4, "racer"))
            d.end_turn(entry)
            d.release(entry)
        store.release.set()
        await asyncio.gather(*d._tasks)
        lengths = [len(loads(v, CFG).history) for v in store.sets]
        assert lengths == [4, 8], "in order; the middle one, with a newer one behind it, skipped"
        assert len(loads(await store.get(snapshot_key("t", "s")), CFG).history) == 8

    asyncio.run(go())
