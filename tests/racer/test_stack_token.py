"""``racer stack`` protects its drafter and verifier: the three processes share a random internal
token (or the one the environment names), and this process can still call the backends with it."""

from __future__ import annotations

import json

import pytest

from common import identity
from racer import stack


@pytest.fixture
def spawned(monkeypatch):
    """Runs ``stack.running`` with the processes and health checks replaced: the environments it
    would start the services with."""
    envs: dict[str, dict[str, str]] = {}

    class _Done:  # an exited process: nothing to stop
        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    def spawn(service, env):
        envs[service] = env
        if env.get("RACER_PORTS_FILE"):  # where it listens, as a service writes it once it does
            with open(env["RACER_PORTS_FILE"], "w", encoding="utf-8") as f:
                json.dump({"grpc": "127.0.0.1:1", "metrics": 0, "http": 0}, f)
        return _Done()

    monkeypatch.setattr(stack, "_spawn", spawn)
    monkeypatch.setattr("verifier.model.resolve_model_dir", lambda model: model)
    monkeypatch.setattr("common.health.wait_serving", lambda *a, **k: None)
    return envs


def test_the_three_services_share_a_random_token(spawned, monkeypatch):
    monkeypatch.delenv("RACER_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("RACER_INTERNAL_TOKEN_FILE", raising=False)
    with stack.running("some-model", pin=False):
        pass
    tokens = {env["RACER_INTERNAL_TOKEN"] for env in spawned.values()}
    assert set(spawned) == {"gateway", "drafter", "verifier"} and len(tokens) == 1
    (token,) = tokens
    assert identity.load_tokens(token) == (token,) and len(token) >= 32
    assert stack.internal_metadata() == identity.metadata((token,))


def test_a_token_from_the_environment_is_used(spawned, monkeypatch):
    mine = "a-token-of-my-own-0123456789"
    monkeypatch.setenv("RACER_INTERNAL_TOKEN", mine)
    with stack.running("some-model", pin=False):
        pass
    assert {env["RACER_INTERNAL_TOKEN"] for env in spawned.values()} == {mine}
    assert stack.internal_metadata() == identity.metadata((mine,))
