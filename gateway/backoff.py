"""Waiting between retries: delays that double up to a cap, until a deadline.

Used where the gateway waits for a dependency to come back: the session store (``records``) and
the drafters and verifiers of a turn (``turn_links``).
"""

from __future__ import annotations

import asyncio
import time


class Backoff:
    """Delays of ``first``, twice that, ... at most ``most`` seconds, while the next one ends before
    ``deadline`` (on ``clock``, monotonic seconds)."""

    def __init__(self, deadline: float, first: float = 0.05, most: float = 1.0, clock=time.monotonic, sleep=None):
        self.deadline = deadline
        self.delay = first
        self.most = most
        self.clock = clock
        self._sleep = sleep or asyncio.sleep

    def over(self) -> bool:
        """The next delay would end past the deadline: time to give up."""
        return self.clock() + self.delay > self.deadline

    async def sleep(self) -> None:
        await self._sleep(self.delay)
        self.delay = min(self.delay * 2, self.most)
