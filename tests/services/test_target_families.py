"""A multi-turn session through the services (gateway, drafter, verifier over gRPC) is lossless
for every target family, whichever backend the verifier gives it."""

from __future__ import annotations

import pytest

from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.families import FAMILIES, model
from tests.support.stack import prompt, start_stack

N = 20


@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_turn_session_equals_greedy_on_the_concatenation(loop_thread, name):
    m = model(name)
    stack = start_stack(loop_thread, m)
    try:
        history: list[int] = []
        session = ""
        with Client(stack.gateway, timeout=60) as c:
            for turn, budget in enumerate((16, 64)):
                p = prompt(40 + turn, n=6)
                ids, _, last = c.complete(p, session_id=session, max_new_tokens=N, budget=budget)
                history += p
                assert ids == hf_greedy(m, history, N), f"turn {turn}"
                history += ids
                session = last.session_id
        held = {s.session_id: s.cache_tokens for s in stack.verifier_sessions()}
        assert held[session] >= len(history) - 1  # the second turn continued the first one's cache
    finally:
        stack.stop()
