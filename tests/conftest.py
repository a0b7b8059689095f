"""Fixtures for every test folder: one intra-op thread, the tiny Llama and the bundled default
model, a Redis, an event loop in a thread. Helpers live in ``tests/support``."""

from __future__ import annotations

import pytest

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
