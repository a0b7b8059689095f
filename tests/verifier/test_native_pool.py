"""The native kernels' thread pool (native_pool.c): calls from several threads at once each get
their own results, and the workers spin only while a forward holds the pool."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.verifier.test_gguf_blocks import _blocks, _run, needs_kernel
from verifier import native

N, K = 64, 512


def _states() -> list[str]:
    """The scheduler state (R, S, D, ...) of each of this process's pool workers."""
    states = []
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "racer-pool":
                continue
            stat = (task / "stat").read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_calls_from_several_threads_at_once_each_get_their_own_bits(threads):
    """One call holds the workers; a call that finds them busy runs on its caller alone. Either way
    every call's result is the one it gets alone on one thread."""
    raw = _blocks("Q4_1", N, K, np.random.default_rng(5))
    xs = [torch.randn((4, K), generator=torch.Generator().manual_seed(s)) for s in range(8)]
    alone = [_run(x, "Q4_1", raw, N, K, threads=1, packed=True) for x in xs]
    before = torch.get_num_threads()

    def calls(i: int) -> bool:
        torch.set_num_threads(threads)  # torch's count is per thread: each worker sets its own
        return all(
            torch.equal(native.quant_linear(xs[j], *_packed(raw), N, K), alone[j])
            for _ in range(40)
            for j in (i, i + 4)
        )

    torch.set_num_threads(threads)
    try:
        with ThreadPoolExecutor(4) as ex:
            assert all(ex.map(calls, range(4)))
    finally:
        torch.set_num_threads(before)  # the tests after this one keep the process's count


def _packed(raw):
    got = native.quant_pack(3, torch.from_numpy(raw.copy()), N, K)
    assert got is not None
    return got


@needs_kernel
def test_workers_spin_through_a_forward_and_sleep_after_it():
    lib = native.library()
    raw = _blocks("Q4_1", N, K, np.random.default_rng(6))
    x = torch.randn((4, K), generator=torch.Generator().manual_seed(7))
    _run(x, "Q4_1", raw, N, K, threads=2, packed=True)
    assert lib.racer_pool_workers() >= 1
    lib.racer_pool_hold(1)
    try:
        _run(x, "Q4_1", raw, N, K, threads=2, packed=True)  # every worker has woken when it returns
        seen = {s for _ in range(200) for s in _states()}
    finally:
        lib.racer_pool_hold(0)
    assert seen and "S" not in seen, seen  # held: between two loops no worker sleeps
    deadline = time.monotonic() + 120
    while set(_states()) != {"S"}:  # released: each sleeps after a few microseconds of spinning
        assert time.monotonic() < deadline, _states()
        time.sleep(0.01)
