"""gateway/backoff.py on an injected clock: the delays double up to the cap, and it gives up before
a delay that would end past the deadline."""

from __future__ import annotations

import asyncio

from gateway.backoff import Backoff


def test_delays_double_to_the_cap_and_stop_before_the_deadline():
    now = [100.0]
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    async def run() -> None:
        b = Backoff(now[0] + 3.0, first=0.25, most=1.0, clock=lambda: now[0], sleep=sleep)
        while not b.over():
            await b.sleep()

    asyncio.run(run())
    assert slept == [0.25, 0.5, 1.0, 1.0]  # 2.75 s; one more second would end at 3.75 > 3
    assert now[0] == 102.75


def test_no_time_left_means_no_wait():
    b = Backoff(5.0, clock=lambda: 5.0)
    assert b.over()
    assert not Backoff(6.0, first=1.0, clock=lambda: 5.0).over()  # a delay that ends at the deadline is taken
