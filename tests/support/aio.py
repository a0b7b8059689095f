"""Asyncio helpers of the tests."""

from __future__ import annotations

import asyncio


async def until(cond) -> None:
    """Yields to the loop until ``cond()``: the other tasks run their next steps, no clock involved."""
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never reached")
