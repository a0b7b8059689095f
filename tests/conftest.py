"""Fixtures for every test folder: one intra-op thread, the tiny Llama and the bundled default
model, a Redis, an event loop in a thread. Helpers live in ``tests/support``."""

from __future__ import annotations

import os

import pytest

# The services these tests start serve float32 unless a test says otherwise: their reference is
# Hugging Face greedy decoding, which is float32's contract. (The default, ``auto``, serves the
# bundled model from its GGUF blocks on a CPU; tests of that set their own dtype.)
os.environ["RACER_DTYPE"] = "float32"
# Attention on float32 vectors, not AMX tiles: on a CPU with AMX the faster of the two is measured at
# first use, and the native decoder runs on the vector path only, so tests that expect it would
# depend on the CPU. The AMX path's own tests name it (tests/verifier/test_native_attention.py).
os.environ["RACER_ATTENTION"] = "vector"

from tests.support.models import make_tiny_llama, single_thread
from tests.support.stack import LoopThread, redis_server


@pytest.fixture(autouse=True)
def _single_thread():
    with single_thread():
        yield


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def default_model():
    from verifier.model import load

    return load()


@pytest.fixture(scope="session")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()
