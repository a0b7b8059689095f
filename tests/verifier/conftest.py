"""Tiny-model tests run single-threaded.

A forward of the tiny Llama takes ~1 ms; with two OpenMP threads on a shared two-core machine the
threads' spin-waits make every op 10-20x slower. Tests marked ``slow`` (the default model) keep the
process's thread count.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_for_tiny_models(request):
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
