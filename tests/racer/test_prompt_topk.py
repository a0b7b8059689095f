"""``--prompt-topk`` (``RACER_PROMPT_TOPK``): the prompt positions whose top-k a verifier's open sends
back, from the settings table through ``racer serve verifier`` to the answer of an open; and a stack
whose verifier sends only the last rows still decodes exactly Hugging Face greedy (the drafter takes
rows for the history's last positions only)."""

from __future__ import annotations

import grpc
import pytest

from common import settings
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc
from racer import launch
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.stack import INTERNAL_TOKEN, backend_channel, prompt, start_stack
from verifier.engine import VerifierSession, measure_prompt_rows


def test_the_flag_and_the_variable_set_it_and_the_last_256_positions_are_the_default():
    assert settings.parse("verifier", ["--prompt-topk", "3"], environ={}).prompt_topk == 3
    assert settings.parse("verifier", environ={"RACER_PROMPT_TOPK": "-1"}).prompt_topk == -1
    assert settings.default("verifier", "--prompt-topk") == 256


@pytest.mark.parametrize(
    "value, asked, rows",
    [(3, None, 3), (0, None, 0), (-1, None, 20), (-1, 2, 2), (3, 5, 3), (3, 0, 0)],
)
def test_a_served_verifier_sends_the_top_k_of_the_prompts_last_positions(loop_thread, tiny_llama, value, asked, rows):
    """The verifier's setting, or fewer rows where an open asks for fewer (``VerifierOpen.prompt_topk``)."""
    history = prompt(5, 20)
    full = VerifierSession(tiny_llama, backend="llama").prefill(history)
    args = launch.defaults(
        "verifier", host="127.0.0.1", port=0, measure_cost=0, internal_token=INTERNAL_TOKEN, prompt_topk=value
    )
    srv, core = loop_thread.run(launch.start_verifier(args, model=tiny_llama))
    try:
        assert core.prompt_topk == (None if value < 0 else value)
        op = vpb.VerifierOpen(session_id="s", tenant="t", history=history, prompt_topk=asked)
        with backend_channel(f"127.0.0.1:{srv.port}") as ch:
            (resp,) = list(vgrpc.VerifierStub(ch).Session(iter([vpb.VerifyRequest(open=op)]), timeout=60))
    except grpc.RpcError as e:
        raise AssertionError(f"open failed: {e.code().name}: {e.details()}") from None
    finally:
        loop_thread.run(srv.stop(0))
        core.close()
    kept = full.topk[len(history) - rows :] if rows else []
    assert list(resp.topk) == [t for row in kept for t in row] and resp.next_token == full.next_token


def test_an_open_asking_for_a_negative_number_of_rows_is_refused(loop_thread, tiny_llama):
    args = launch.defaults("verifier", host="127.0.0.1", port=0, measure_cost=0, internal_token=INTERNAL_TOKEN)
    srv, core = loop_thread.run(launch.start_verifier(args, model=tiny_llama))
    try:
        op = vpb.VerifierOpen(session_id="s", tenant="t", history=prompt(5, 8), prompt_topk=-1)
        with backend_channel(f"127.0.0.1:{srv.port}") as ch, pytest.raises(grpc.RpcError) as e:
            list(vgrpc.VerifierStub(ch).Session(iter([vpb.VerifyRequest(open=op)]), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_topk" in e.value.details()
        assert not core.stats()  # refused before a session was made
    finally:
        loop_thread.run(srv.stop(0))
        core.close()


@pytest.mark.parametrize("value, measured, rows", [(256, 5, 5), (3, 5, 3), (256, None, 256), (-1, 5, None), (0, 5, 0)])
def test_with_a_cost_curve_the_rows_are_at_most_what_costs_one_step(
    loop_thread, tiny_llama, monkeypatch, value, measured, rows
):
    """Where the verifier measures its cost curve it also measures how many prompt rows' top-k cost one
    one-token step, and sends at most that many: --prompt-topk stays the upper bound, -1 (every
    position) and 0 (none) are taken as they are, and a bound it cannot measure bounds nothing."""
    from verifier import engine

    asked = []

    def bound(model, step_ms, **kw):
        asked.append(step_ms)
        return measured

    monkeypatch.setattr(engine, "measure_cost_slope", lambda model, **kw: ({1: 7.0, 2: 9.0}, None))
    monkeypatch.setattr(engine, "measure_prompt_rows", bound)
    args = launch.defaults("verifier", host="127.0.0.1", port=0, internal_token=INTERNAL_TOKEN, prompt_topk=value)
    srv, core = loop_thread.run(launch.start_verifier(args, model=tiny_llama))
    try:
        assert core.prompt_topk == rows
        assert asked == ([7.0] if value > 0 else [])  # against the one-node step's cost
    finally:
        loop_thread.run(srv.stop(0))
        core.close()


def test_the_rows_that_cost_one_step_are_measured_on_the_model(tiny_llama):
    free = measure_prompt_rows(tiny_llama, 0.0, rows=16, reps=1)
    assert free is None or free == 0  # no time to spend: no row (or rows that cost nothing measurable)
    some = measure_prompt_rows(tiny_llama, 1e9, rows=16, reps=1)
    assert some is None or some > 1000


@pytest.fixture
def drafter_opens(monkeypatch) -> list[tuple[int, int]]:
    """(history tokens, top-k rows) of each drafter open, in order."""
    from drafter import core as drafter_core

    opened: list[tuple[int, int]] = []
    real = drafter_core._catch_up

    def recorded(session, history, rows):
        opened.append((len(history), len(rows)))
        return real(session, history, rows)

    monkeypatch.setattr(drafter_core, "_catch_up", recorded)
    return opened


def test_a_stack_whose_verifier_sends_the_last_rows_only_decodes_greedy(loop_thread, tiny_llama, drafter_opens):
    opened = drafter_opens
    st = start_stack(loop_thread, tiny_llama)
    try:
        st.verifiers[0][1].prompt_topk = 2  # what --prompt-topk 2 sets (the stack's backend settings are shared)
        p = prompt(6, 24)
        with Client(st.gateway, timeout=60) as c:
            ids, _, _ = c.complete(p, max_new_tokens=24)
        assert ids == hf_greedy(tiny_llama, p, 24)
        assert opened[0] == (24, 2)  # the drafter held the prompt with the rows of its last 2 positions
    finally:
        st.stop()


@pytest.mark.parametrize("mode, rows", [("off", 0), ("racer", 24)])
def test_a_turn_that_drafts_nothing_asks_for_no_rows(loop_thread, tiny_llama, drafter_opens, mode, rows):
    """An ``off`` turn's open asks the verifier for no prompt rows (the output layer then runs over the
    last row only); a drafting turn's gets every row. Both decode greedy."""
    opened = drafter_opens
    st = start_stack(loop_thread, tiny_llama)
    try:
        p = prompt(7, 24)
        with Client(st.gateway, timeout=60) as c:
            ids, _, _ = c.complete(p, max_new_tokens=16, mode=mode)
        assert ids == hf_greedy(tiny_llama, p, 16)
        assert opened[0] == (24, rows)
    finally:
        st.stop()
