"""These tests run with one intra-op thread.

A forward of the tiny Llama takes ~1 ms; with two OpenMP threads on a busy two-core machine (other
processes, parallel test jobs) the threads' spin-waits make every op 5-20x slower, for the default
model too (measured: 48 tokens of SmolLM2-135M, 6 s with one thread vs 30 s with two while the
other core was busy). One thread costs at most ~1.6x on an idle machine.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
