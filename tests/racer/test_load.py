"""``racer load`` at test size: 16 sessions x 3 turns on the tiny model, every output checked against
plain greedy decoding, nothing left behind once the sessions are closed."""

from __future__ import annotations

import asyncio

import pytest
import redis
from prometheus_client import REGISTRY

from racer.bench.loadgen import check_loopback, make_prompts, percentiles, run_load
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.holds import held_rounds
from tests.support.stack import start_stack, wait_until

SESSIONS, TURNS, NEW, PROMPT = 16, 3, 12, 6


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama, redis_url):
    st = start_stack(loop_thread, tiny_llama, drafters=2, verifiers=2, snapshot_url=redis_url, session_url=redis_url)
    yield st
    st.stop()


def test_sixteen_sessions_three_turns_all_lossless_and_nothing_leaks(stack, tiny_llama, redis_url):
    report = asyncio.run(
        run_load(
            stack.gateway, SESSIONS, TURNS, NEW, seed=7, ids_vocab=96, prompt_tokens=PROMPT, time_limit=240, budget=8
        )
    )
    assert report.errors == {} and report.completed_turns == SESSIONS * TURNS, report.format()
    assert report.tokens == SESSIONS * TURNS * NEW
    assert 0 < report.ttft_ms["p50"] <= report.ttft_ms["p99"] and 0 < report.itl_ms["p50"] <= report.itl_ms["p99"]
    assert report.tokens_per_s > 0
    prompts = make_prompts(SESSIONS, TURNS, 7, 96, PROMPT)
    sids = set()
    for i, run in enumerate(report.runs):
        history: list[int] = []
        for t, turn in enumerate(run.turns):
            assert turn.prompt == prompts[i][t]
            history += turn.prompt
            assert turn.ids == hf_greedy(tiny_llama, history, NEW), f"session {i} turn {t}"
            history += turn.ids
        sids.add(run.session_id)
    assert len(sids) == SESSIONS
    print(report.format())
    # closed at the end: no record, no drafter state, no KV cache, no snapshot, no stream
    with Client(stack.gateway) as c:
        assert not sids & {s.session_id for s in c.list_sessions()}
    gw = stack.gateway_pair[1]
    assert not gw._turns
    assert all(v == 0 for v in gw.backends.verifier_load.values())
    assert REGISTRY.get_sample_value("racer_active_streams") == 0
    held = {s.session_id for i in range(2) for s in stack.drafter_sessions(i)}
    held |= {s.session_id for i in range(2) for s in stack.verifier_sessions(i)}
    assert not sids & held
    r = redis.Redis.from_url(redis_url)
    wait_until(
        lambda: not any(r.exists(f"racer:{kind}:local:{sid}") for sid in sids for kind in ("session", "drafter")),
        what="no record or snapshot left in Redis",
    )


def test_load_is_bounded_and_loopback_only():
    check_loopback("127.0.0.1:50051")
    check_loopback("localhost:50051")
    for bad in ("10.0.0.1:50051", "8.8.8.8:53"):
        with pytest.raises(ValueError, match="loopback"):
            check_loopback(bad)
    for kw in (
        dict(sessions=0),
        dict(sessions=10_000),
        dict(turns=100),
        dict(max_new_tokens=10**6),
        dict(time_limit=10**5),
    ):
        with pytest.raises(ValueError):
            asyncio.run(run_load("127.0.0.1:1", **kw))
    assert make_prompts(3, 2, 5) == make_prompts(3, 2, 5) != make_prompts(3, 2, 6)
    assert percentiles([float(x) for x in range(1, 101)]) == {"p50": 50.0, "p99": 99.0, "max": 100.0}


def test_a_run_past_its_time_limit_stops_and_says_so(stack):
    # The turns' rounds are held (after each turn's open, at the latest) until the run has stopped:
    # no turn can end within the time limit, however fast the machine.
    with held_rounds(stack.lt, [core for _, core in stack.verifiers]):
        report = asyncio.run(
            run_load(stack.gateway, 2, 1, 1000, seed=1, ids_vocab=96, time_limit=0.3, budget=1, mode="off")
        )
        assert report.errors.get("TIME_LIMIT") == 2 and report.completed_turns == 0
        gw = stack.gateway_pair[1]  # the gateway ends the cancelled turns itself, its verifier still held
        wait_until(lambda: not gw._turns, timeout=60, what="the cancelled turns ended")
