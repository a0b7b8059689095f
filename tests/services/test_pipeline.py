"""End to end through the gateway: lossless, multi-turn, routing, failover, tenants, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import grpc
import pytest
import redis
from prometheus_client import REGISTRY

from common.loop import generate
from common.params import MODES, GenerationParams, SamplingParams
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc
from drafter.draft_session import DraftSession
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.holds import held_rounds
from tests.support.stack import backend_channel, prompt, start_stack, wait_until
from verifier.engine import VerifierSession

N = 40


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama, redis_url):
    st = start_stack(loop_thread, tiny_llama, drafters=2, snapshot_url=redis_url, session_url=redis_url)
    yield st
    st.stop()


@pytest.mark.parametrize("mode", MODES)
def test_output_is_plain_greedy_for_every_mode(stack, tiny_llama, mode):
    p = prompt(1)
    with Client(stack.gateway, timeout=60) as c:
        ids, _, last = c.complete(p, max_new_tokens=N, mode=mode, budget=16)
    assert ids == hf_greedy(tiny_llama, p, N)
    assert last.finish_reason == "length" and last.usage.completion_tokens == N
    s = last.stats
    assert s.rounds >= 1 and s.accepted <= s.drafted
    assert s.mat == pytest.approx((s.accepted + s.rounds) / s.rounds)
    if mode == "off":
        assert s.drafted == 0


def test_budget_one_and_stop_ids(stack, tiny_llama):
    p = prompt(2)
    ref = hf_greedy(tiny_llama, p, N)
    stop = ref[17]
    with Client(stack.gateway, timeout=60) as c:
        ids, _, last = c.complete(p, max_new_tokens=N, budget=1)
        assert ids == ref
        ids, _, last = c.complete(p, max_new_tokens=N, stop_ids=(stop,))
    assert ids == ref[: ref.index(stop) + 1]
    assert last.finish_reason == "stop"


def test_three_turn_session_equals_greedy_on_the_concatenation(stack, tiny_llama):
    history: list[int] = []
    session = ""
    with Client(stack.gateway, timeout=60) as c:
        for turn in range(3):
            p = prompt(10 + turn, n=5)
            ids, _, last = c.complete(p, session_id=session, max_new_tokens=25, budget=8)
            history += p
            assert ids == hf_greedy(tiny_llama, history, 25), f"turn {turn}"
            history += ids
            session = last.session_id
            assert last.usage.prompt_tokens == 5 and last.usage.session_tokens == len(history)
        info = c.get_session(session)
    assert info.turns == 3 and info.tokens == len(history)
    # the KV cache carried over: the verifier holds the whole session (minus what was never fed)
    held = {s.session_id: s.cache_tokens for s in stack.verifier_sessions()}
    assert held[session] >= len(history) - 1


def test_sessions_spread_over_both_drafters(stack):
    with Client(stack.gateway, timeout=60) as c:
        sids = [c.complete(prompt(100 + i), max_new_tokens=4)[2].session_id for i in range(12)]
    per = [{s.session_id for s in stack.drafter_sessions(i)} for i in range(2)]
    assert len(per[0] & set(sids)) >= 1 and len(per[1] & set(sids)) >= 1
    assert not (per[0] & per[1] & set(sids)), "a session lives on one drafter"


def test_unknown_session_and_bad_requests_get_clear_statuses(stack):
    with Client(stack.gateway, timeout=30) as c:
        cases = [
            (dict(prompt=[5, 6], session_id="nope"), grpc.StatusCode.NOT_FOUND, "session_id"),
            (dict(prompt=[5, 600]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids"),
            (dict(prompt=[5, 6], mode="magic"), grpc.StatusCode.INVALID_ARGUMENT, "speculation.mode"),
            (dict(prompt=[5, 6], max_new_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
            (dict(prompt=[5, 6], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
            (dict(prompt=None), grpc.StatusCode.INVALID_ARGUMENT, "input"),
            (dict(prompt="text but no tokenizer"), grpc.StatusCode.FAILED_PRECONDITION, "prompt_ids"),
        ]
        for kw, code, field in cases:
            p = kw.pop("prompt")
            with pytest.raises(grpc.RpcError) as e:
                c.complete(p, **kw)
            assert e.value.code() == code, (kw, e.value.details())
            assert field in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.get_session("nope")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_sampling_through_the_services_equals_the_in_process_engine(stack, tiny_llama):
    p = prompt(3)
    with Client(stack.gateway, timeout=60) as c:
        ids, _, _ = c.complete(p, max_new_tokens=N, temperature=0.8, top_p=0.9, seed=1234, budget=8)
    sampling = SamplingParams(0.8, 0.9, 0, 1234)
    local = [
        t
        for ch in generate(
            DraftSession(),
            VerifierSession(tiny_llama, sampling=sampling),
            p,
            GenerationParams(max_new_tokens=N, budget=8),
        )
        for t in ch
    ]
    assert ids == local


def test_close_session_frees_state_everywhere(stack, redis_url):
    with Client(stack.gateway, timeout=60) as c:
        sid = c.complete(prompt(4), max_new_tokens=10)[2].session_id
        r = redis.Redis.from_url(redis_url)
        wait_until(lambda: r.exists(f"racer:drafter:local:{sid}"), what="snapshot written at turn end")
        info = c.close_session(sid)
        assert info.closed and info.turns == 1
        with pytest.raises(grpc.RpcError) as e:
            c.complete([5], session_id=sid, max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert not r.exists(f"racer:drafter:local:{sid}") and not r.exists(f"racer:session:local:{sid}")
    assert sid not in {s.session_id for i in range(2) for s in stack.drafter_sessions(i)}
    assert sid not in {s.session_id for s in stack.verifier_sessions()}


def test_an_off_turn_asks_the_drafter_for_no_tree_and_the_next_turn_catches_it_up(stack, tiny_llama):
    """Mode off drafts nothing, so its rounds skip the drafter (no step); the drafter's session learns
    the turn's tokens when the next turn opens it, and every turn is still plain greedy."""

    def steps() -> float:
        return REGISTRY.get_sample_value("racer_draft_latency_seconds_count") or 0.0

    history: list[int] = []
    sid = ""
    with Client(stack.gateway, timeout=60) as c:
        for turn, mode in enumerate(("racer", "off", "racer")):
            p = prompt(70 + turn, n=5)
            opened = len(history + p)  # what the turn's drafter open holds
            before = steps()
            ids, _, last = c.complete(p, session_id=sid, max_new_tokens=20, mode=mode, budget=8)
            history += p
            assert ids == hf_greedy(tiny_llama, history, 20), f"turn {turn}"
            history += ids
            sid = last.session_id
            assert (steps() > before) == (mode != "off"), f"turn {turn}"
    held = {s.session_id: s.tokens for i in range(2) for s in stack.drafter_sessions(i)}
    assert held[sid] > opened  # the off turn's tokens too, and the last turn's steps


def test_the_round_overheads_the_adaptive_budget_counts_are_measured_by_kind_of_round(stack):
    """The gateway averages what a round takes beyond the verifier's time, drafted rounds and rounds
    without the drafter apart, and opens drafters with both; a turn in mode off moves only the plain
    figure, a turn with a fixed budget (every round drafted) only the drafted one."""
    from gateway.turn_links import PLAIN_OVERHEAD_MS, ROUND_OVERHEAD_MS, RoundOverhead

    gw = stack.gateway_pair[1]
    gw.round_overhead = RoundOverhead()
    gw.plain_overhead = RoundOverhead(PLAIN_OVERHEAD_MS, "plain")

    def gauge(kind: str) -> float:
        return REGISTRY.get_sample_value("racer_round_overhead_seconds", {"round": kind})

    assert gauge("drafted") == pytest.approx(ROUND_OVERHEAD_MS / 1e3)
    assert gauge("plain") == pytest.approx(PLAIN_OVERHEAD_MS / 1e3)
    with Client(stack.gateway, timeout=60) as c:
        c.complete(prompt(75), max_new_tokens=20, mode="off")
        assert gw.round_overhead.ms == ROUND_OVERHEAD_MS
        assert gw.plain_overhead.ms != PLAIN_OVERHEAD_MS and gw.plain_overhead.ms >= 0
        plain = gw.plain_overhead.ms
        c.complete(prompt(76), max_new_tokens=20, mode="racer", budget=4)
    assert gw.round_overhead.ms != ROUND_OVERHEAD_MS and gw.round_overhead.ms >= 0
    assert gw.plain_overhead.ms == plain
    assert gauge("drafted") == pytest.approx(gw.round_overhead.ms / 1e3)
    assert gauge("plain") == pytest.approx(plain / 1e3)


def test_a_round_overhead_sample_is_clamped_and_a_non_finite_one_ignored():
    from gateway.turn_links import RoundOverhead

    o = RoundOverhead(2.0)
    o.observe(1e6, 1.0)  # a stalled round counts as CAP_MS
    assert o.ms == pytest.approx(2.0 + o.WEIGHT * (o.CAP_MS - 2.0))
    before = o.ms
    o.observe(5.0, 9.0)  # the verifier's clock ahead of the gateway's: counts as 0
    assert o.ms == pytest.approx(before * (1 - o.WEIGHT))
    before = o.ms
    o.observe(float("nan"), 1.0)
    assert o.ms == before


def test_cancelled_stream_frees_drafter_and_verifier_streams(stack):
    def released():
        d = [s for i in range(2) for s in stack.drafter_sessions(i) if s.session_id == sid]
        v = [s for s in stack.verifier_sessions() if s.session_id == sid]
        return all(not s.streaming for s in d + v)

    # the turn's rounds are held after its first chunk: the cancel ends a running turn, on any machine
    with held_rounds(stack.lt, [core for _, core in stack.verifiers]) as hold:
        c = Client(stack.gateway)
        call = c.generate(prompt(5), max_new_tokens=1000, budget=2, mode="off")
        first = next(call)
        sid = first.session_id
        assert hold.reached.wait(60) and hold.held == {sid}
        assert not released(), "the turn's streams were not open when it was cancelled"
        call.cancel()
        c.close()
        wait_until(released, timeout=60, what="drafter and verifier streams closed")
    with Client(stack.gateway) as c2, pytest.raises(grpc.RpcError) as e:
        c2.get_session(sid)  # a cancelled first turn leaves no session behind
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_drafter_stopping_mid_session_does_not_change_the_output(loop_thread, tiny_llama, redis_url):
    st = start_stack(
        loop_thread, tiny_llama, drafters=2, snapshot_url=redis_url, session_url=redis_url, snapshot_every=4
    )
    try:
        p = prompt(6)
        with Client(st.gateway, timeout=60) as c:
            ids1, _, last = c.complete(p, max_new_tokens=30, budget=8)
            sid = last.session_id
            owner = next(i for i in range(2) if sid in {s.session_id for s in st.drafter_sessions(i)})
            p2 = prompt(7, n=4)
            # the next turn starts on the owner; stop it after the first chunk of the stream, the turn's
            # first round held meanwhile (its drafter step answered), so the turn needs the drafter again
            restored = REGISTRY.get_sample_value("racer_drafter_restores_total", {"source": "snapshot"}) or 0
            with held_rounds(st.lt, [core for _, core in st.verifiers], sessions=[sid]) as hold:
                call = c.generate(p2, session_id=sid, max_new_tokens=120, budget=4)
                got = list(next(call).token_ids)
                assert hold.reached.wait(60)
                st.stop_drafter(owner, grace=0)
            for r in call:
                got.extend(r.token_ids)
                last = r
        other = 1 - owner
        assert sid in {s.session_id for s in st.drafter_sessions(other)}, "the other drafter took the session over"
        assert REGISTRY.get_sample_value("racer_drafter_restores_total", {"source": "snapshot"}) == restored + 1
        assert got == hf_greedy(tiny_llama, p + ids1 + p2, 120)
        assert last.usage.completion_tokens == 120
    finally:
        st.stop()


def test_tenants_are_isolated(loop_thread, tiny_llama, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nkey-a acme\nkey-b globex\n")
    st = start_stack(loop_thread, tiny_llama, api_keys=str(keys))
    try:
        with Client(st.gateway, api_key="key-a", timeout=30) as a, Client(st.gateway, api_key="key-b", timeout=30) as b:
            sid = a.complete(prompt(8), max_new_tokens=5)[2].session_id
            for call in (
                lambda: b.get_session(sid),
                lambda: b.close_session(sid),
                lambda: b.complete([5, 6], session_id=sid, max_new_tokens=2),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert [s.session_id for s in a.list_sessions()] == [sid]
            assert b.list_sessions() == []
            assert a.get_session(sid).turns == 1
        for key in (None, "wrong"):
            with Client(st.gateway, api_key=key, timeout=30) as anon, pytest.raises(grpc.RpcError) as e:
                anon.complete([5], max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        tenants = {s.tenant for s in st.drafter_sessions(0)} | {s.tenant for s in st.verifier_sessions()}
        assert tenants == {"acme"}
    finally:
        st.stop()


def test_concurrent_sessions_all_lossless(stack, tiny_llama):
    results = {}

    def one(i):
        with Client(stack.gateway, timeout=120) as c:
            results[i] = c.complete(prompt(200 + i), max_new_tokens=24, budget=8)[0]

    batcher = stack.verifiers[0][1].batcher
    before = len(batcher.sizes)
    # Each session's first round waits until all six have one waiting: then their trees reach the
    # verifier together, however fast a machine runs a turn before the next one starts.
    with held_rounds(stack.lt, [core for _, core in stack.verifiers]) as hold:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        wait_until(lambda: len(hold.held) == 6, timeout=60, what="every session's first round waiting")
        hold.release()
        for t in threads:
            t.join()
    assert {i: results.get(i) for i in range(6)} == {i: hf_greedy(tiny_llama, prompt(200 + i), 24) for i in range(6)}
    assert max(batcher.sizes[before:]) > 1, "concurrent sessions' trees were never verified together"


@contextlib.contextmanager
def handed_to_model_thread(svc):
    """Sizes of the trees ``svc`` hands to its model thread while the block runs."""
    from verifier.batcher import _timed_verify

    handed: list[int] = []
    thread = svc.model_thread
    real = thread.submit

    def spy(tenant, cost, kind, fn, *args):
        if fn is _timed_verify:
            handed.append(len(args[0][0][1]))
        return real(tenant, cost, kind, fn, *args)

    thread.submit = spy
    try:
        yield handed
    finally:
        del thread.submit


def _random_tree(rng, n):
    return [rng.randrange(3, 96) for _ in range(n)], [-1] + [rng.randrange(i) for i in range(1, n)]


def _same(got, want):
    assert (list(got.accepted), got.next_token) == (want.accepted, want.bonus)
    assert list(got.topk) == [t for row in want.topk for t in row]


def test_a_lone_streams_small_trees_are_verified_inline_and_all_trees_match_the_engine(stack, tiny_llama):
    """A lone stream's trees up to INLINE_NODES are verified on the event loop, bigger ones on the
    model thread (the loop stays free for health checks); either way the results are the in-process
    verifier's."""
    from verifier.batcher import INLINE_NODES

    svc = stack.verifiers[0][1]
    wait_until(lambda: svc.streaming() == 0 and not svc.busy, what="no verifier stream open")
    rng = random.Random(7)
    history = prompt(300)
    trees = [_random_tree(rng, n) for n in (3, INLINE_NODES, INLINE_NODES + 1, 3 * INLINE_NODES)]
    ref = VerifierSession(tiny_llama, backend="llama")
    ref.prefill(history)
    want = [ref.verify(t, p) for t, p in trees]
    with handed_to_model_thread(svc) as handed, backend_channel(stack.verifier_target(0)) as ch:
        reqs = [vpb.VerifyRequest(open=vpb.VerifierOpen(session_id="inline", tenant="t", history=history))]
        reqs += [vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=t, parents=p)) for t, p in trees]
        got = list(vgrpc.VerifierStub(ch).Session(iter(reqs), timeout=60))[1:]
    assert handed == [INLINE_NODES + 1, 3 * INLINE_NODES]
    for g, w in zip(got, want, strict=True):
        _same(g, w)


def test_a_lone_streams_inline_forward_runs_on_every_thread(stack, monkeypatch):
    """With its rounds confined to fewer threads, a lone stream's inline forward still takes every
    thread (its drafter and gateway wait for it); one handed to the model thread does not."""
    from verifier import batcher, native

    monkeypatch.setattr(native, "_round", {"threads": 1})
    seen: list[tuple[int, int]] = []
    real = batcher._timed_verify

    def spy(items):
        import torch

        seen.append((native.threads(1), torch.get_num_threads()))  # OpenMP counts are per thread
        return real(items)

    monkeypatch.setattr(batcher, "_timed_verify", spy)
    svc = stack.verifiers[0][1]
    wait_until(lambda: svc.streaming() == 0 and not svc.busy, what="no verifier stream open")
    rng = random.Random(9)
    trees = [_random_tree(rng, 3), _random_tree(rng, batcher.INLINE_NODES + 1)]
    with backend_channel(stack.verifier_target(0)) as ch:
        reqs = [vpb.VerifyRequest(open=vpb.VerifierOpen(session_id="lone", tenant="t", history=prompt(302)))]
        reqs += [vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=t, parents=p)) for t, p in trees]
        assert len(list(vgrpc.VerifierStub(ch).Session(iter(reqs), timeout=60))) == 3
    (lone, every), (handed, _) = seen
    assert (lone, handed) == (every, 1)


def test_a_small_tree_waits_for_a_busy_model_thread_and_after_a_slow_forward_uses_it(stack, tiny_llama):
    """The loop never runs a forward while the model thread works (a cancelled stream's prefill,
    say), nor when the last forward took longer than INLINE_MS."""
    from verifier.batcher import INLINE_MS

    svc = stack.verifiers[0][1]
    wait_until(lambda: svc.streaming() == 0 and not svc.busy, what="no verifier stream open")
    rng = random.Random(8)
    history = prompt(301)
    trees = [_random_tree(rng, 3), _random_tree(rng, 3)]
    ref = VerifierSession(tiny_llama, backend="llama")
    ref.prefill(history)
    want = [ref.verify(t, p) for t, p in trees]
    gates = [threading.Event(), threading.Event()]

    def reqs():
        yield vpb.VerifyRequest(open=vpb.VerifierOpen(session_id="held", tenant="t", history=history))
        for gate, (t, p) in zip(gates, trees):
            gate.wait(30)
            yield vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=t, parents=p))

    release = threading.Event()
    with handed_to_model_thread(svc) as handed, backend_channel(stack.verifier_target(0)) as ch:
        responses = vgrpc.VerifierStub(ch).Session(reqs(), timeout=60)
        next(responses)  # opened
        holder = asyncio.run_coroutine_threadsafe(svc._run(release.wait, 30), stack.lt.loop)
        wait_until(lambda: svc.busy == 1, what="the model thread held")
        gates[0].set()
        wait_until(lambda: handed == [3], what="the tree handed to the busy model thread")
        release.set()
        _same(next(responses), want[0])
        holder.result(10)
        wait_until(lambda: svc.busy == 0, what="the model thread free")
        svc.batcher.last_forward = (INLINE_MS + 1) / 1e3  # as if the last forward had been slow
        gates[1].set()
        _same(next(responses), want[1])
        responses.cancel()
    assert handed == [3, 3]


def test_a_key_file_without_keys_lets_nobody_in(loop_thread, tiny_llama, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# no keys yet\n")
    st = start_stack(loop_thread, tiny_llama, api_keys=str(keys))
    try:
        for key in (None, "anything"):
            with Client(st.gateway, api_key=key, timeout=30) as c, pytest.raises(grpc.RpcError) as e:
                c.complete([5], max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        st.stop()


def test_evicted_kv_cache_is_re_prefilled_and_output_unchanged(loop_thread, tiny_llama):
    st = start_stack(loop_thread, tiny_llama)
    try:
        st.verifiers[0][1].max_sessions = 2
        with Client(st.gateway, timeout=60) as c:
            first = c.complete(prompt(20), max_new_tokens=10)
            sid = first[2].session_id
            for i in range(2):  # two more sessions push the first one's cache out
                c.complete(prompt(21 + i), max_new_tokens=10)
            assert sid not in {s.session_id for s in st.verifier_sessions()}
            before = REGISTRY.get_sample_value("racer_verifier_reused_tokens_total") or 0
            p2 = prompt(30, n=4)
            ids, _, last = c.complete(p2, session_id=sid, max_new_tokens=20)
        assert ids == hf_greedy(tiny_llama, prompt(20) + first[0] + p2, 20)
        assert REGISTRY.get_sample_value("racer_verifier_reused_tokens_total") == before  # a full re-prefill
        assert len(st.verifier_sessions()) == 2
    finally:
        st.stop()


def test_idle_sessions_expire_in_drafter_and_verifier(loop_thread, tiny_llama):
    st = start_stack(loop_thread, tiny_llama)
    try:
        with Client(st.gateway, timeout=60) as c:
            c.complete(prompt(40), max_new_tokens=5)
        (_, drafter), (_, verifier) = st.drafters[0], st.verifiers[0]
        assert len(drafter.sessions) == 1 and len(verifier.sessions) == 1
        assert loop_thread.run(drafter.expire()) == 0 and loop_thread.run(verifier.expire()) == 0  # not idle yet
        drafter.ttl = verifier.ttl = 0.0
        assert loop_thread.run(drafter.expire()) == 1 and loop_thread.run(verifier.expire()) == 1
        assert not drafter.sessions and not verifier.sessions
    finally:
        st.stop()


def test_speculation_metrics_count_what_the_stream_reports(stack):
    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (
        value("racer_spec_decode_num_drafts_total", mode="racer"),
        value("racer_spec_decode_num_draft_tokens_total", mode="racer"),
        value("racer_spec_decode_num_accepted_tokens_total", mode="racer"),
        value("racer_spec_decode_num_accepted_tokens_per_pos_total", position="1"),
    )
    with Client(stack.gateway, timeout=60) as c:
        _, _, last = c.complete(prompt(50), max_new_tokens=N, budget=16)
    after = (
        value("racer_spec_decode_num_drafts_total", mode="racer"),
        value("racer_spec_decode_num_draft_tokens_total", mode="racer"),
        value("racer_spec_decode_num_accepted_tokens_total", mode="racer"),
        value("racer_spec_decode_num_accepted_tokens_per_pos_total", position="1"),
    )
    s = last.stats
    assert after[0] - before[0] == s.rounds
    assert after[1] - before[1] == s.drafted
    assert after[2] - before[2] == s.accepted
    assert 0 < after[3] - before[3] <= s.rounds  # rounds that accepted at least one draft token


def test_latency_metrics_are_in_seconds_and_count_what_the_stream_did(stack):
    """Base units: a turn's round, verify, first-token and per-token times add up to less than its
    wall time in seconds (milliseconds would not); counts follow the stream."""

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    names = (
        "racer_round_latency_seconds_count",
        "racer_round_latency_seconds_sum",
        "racer_verify_latency_seconds_sum",
        "racer_time_to_first_token_seconds_count",
        "racer_time_to_first_token_seconds_sum",
        "racer_time_per_output_token_seconds_count",
        "racer_time_per_output_token_seconds_sum",
    )
    before = {n: value(n) for n in names}
    tokens = value("racer_generation_tokens_total", tenant="local")
    t0 = time.perf_counter()
    with Client(stack.gateway, timeout=60) as c:
        ids, _, last = c.complete(prompt(51), max_new_tokens=N, budget=16)
    wall = time.perf_counter() - t0
    d = {n: value(n) - before[n] for n in names}
    assert value("racer_generation_tokens_total", tenant="local") - tokens == len(ids) == N
    assert d["racer_round_latency_seconds_count"] == last.stats.rounds
    assert d["racer_time_to_first_token_seconds_count"] == 1
    assert d["racer_time_per_output_token_seconds_count"] == N - 1  # every token after the first
    for n in ("racer_round_latency_seconds_sum", "racer_verify_latency_seconds_sum"):
        assert 0 < d[n] < wall, n
    assert 0 < d["racer_time_to_first_token_seconds_sum"] + d["racer_time_per_output_token_seconds_sum"] < wall


def test_the_adaptive_budget_rests_when_no_tree_pays_and_the_drafter_still_learns_every_token(stack, tiny_llama):
    """When a drafted round's overhead outweighs what any tree is expected to gain, the drafter tells
    the gateway to rest: rounds go to the verifier alone (fewer steps than rounds), and the step after
    each rest carries its tokens. The output stays plain greedy, and the drafter's session holds the
    turn's tokens in order: the next turn's open finds it in memory, its history a prefix of the
    session's."""
    from gateway.turn_links import RoundOverhead

    def sample(name: str, labels=None) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    gw = stack.gateway_pair[1]
    kept = gw.round_overhead
    gw.round_overhead = RoundOverhead(10_000.0)  # a drafted round looks far too dear: no tree pays
    history: list[int] = []
    sid = ""
    try:
        with Client(stack.gateway, timeout=60) as c:
            for turn in range(2):
                p = prompt(80 + turn, n=6)
                steps = sample("racer_draft_latency_seconds_count")
                runs = sample("racer_verifier_run_rounds_total")
                found = {s: sample("racer_drafter_restores_total", {"source": s}) for s in ("memory", "snapshot")}
                ids, _, last = c.complete(p, session_id=sid, max_new_tokens=40, budget=0)
                history += p
                assert ids == hf_greedy(tiny_llama, history, 40), f"turn {turn}"
                history += ids
                sid = last.session_id
                rounds = last.stats.rounds
                assert sample("racer_draft_latency_seconds_count") - steps < rounds / 2, f"turn {turn}"
                assert sample("racer_verifier_run_rounds_total") > runs, f"turn {turn}: the rests went as runs"
                if turn:
                    assert sample("racer_drafter_restores_total", {"source": "memory"}) == found["memory"] + 1
                    assert sample("racer_drafter_restores_total", {"source": "snapshot"}) == found["snapshot"]
    finally:
        gw.round_overhead = kept


def _count(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_rounds_without_a_tree_go_to_the_verifier_as_one_run(stack, tiny_llama):
    """Mode off: the gateway asks the verifier for the turn's rounds as one run, which answers each
    round (the first by its request, the others without one) and ends at a stop token; the output is
    plain greedy. With runs off, or with stop strings (found in the text only after the fact), the
    same tokens come from a request per round."""
    p = prompt(90)
    ref = hf_greedy(tiny_llama, p, N)
    stop = ref[1 + ref[1:].index(ref[20])]  # no earlier token is it, but maybe the first
    gw = stack.gateway_pair[1]
    with Client(stack.gateway, timeout=60) as c:
        runs, forwards = _count("racer_verifier_run_rounds_total"), _count("racer_verify_latency_seconds_count")
        ids, _, last = c.complete(p, max_new_tokens=N, mode="off")
        assert ids == ref
        rounds = last.stats.rounds
        assert rounds == N - 1  # the open chose the first token
        assert _count("racer_verifier_run_rounds_total") - runs == rounds - 1
        assert _count("racer_verify_latency_seconds_count") - forwards == rounds

        runs, forwards = _count("racer_verifier_run_rounds_total"), _count("racer_verify_latency_seconds_count")
        ids, _, last = c.complete(p, max_new_tokens=N, mode="off", stop_ids=(stop,))
        cut = ref.index(stop, 1) + 1
        assert ids == ref[:cut] and last.finish_reason == "stop"
        assert last.stats.rounds == cut - 1
        assert _count("racer_verifier_run_rounds_total") - runs == cut - 2
        assert _count("racer_verify_latency_seconds_count") - forwards == cut - 1  # nothing past the stop

        runs = _count("racer_verifier_run_rounds_total")
        ids, _, _ = c.complete(p, max_new_tokens=N, mode="off", stop=("a stop string this text never holds",))
        assert ids == ref and _count("racer_verifier_run_rounds_total") == runs
        gw.runs = False
        try:
            ids, _, _ = c.complete(p, max_new_tokens=N, mode="off")
        finally:
            gw.runs = True
        assert ids == ref and _count("racer_verifier_run_rounds_total") == runs


def test_a_verifier_run_answers_each_round_and_ends_at_a_stop_token(stack, tiny_llama):
    """Over a raw stream: a run's responses are the greedy tokens one round each, every one but the
    last with ``more``; it ends after the round that chose a stop token, and the stream goes on with
    ordinary requests after it."""
    history = prompt(301)
    ref = hf_greedy(tiny_llama, history, 16)
    k = 1 + ref[1:].index(ref[6])  # the first round (after the open's token) whose next token is ref[6]
    with backend_channel(stack.verifier_target(0)) as ch:
        op = vpb.VerifierOpen(session_id="run", tenant="t", history=history, stop_ids=[ref[6]])
        reqs = [
            vpb.VerifyRequest(open=op),
            vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[ref[0]], parents=[-1], run=12)),
            vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[ref[k]], parents=[-1])),
        ]
        got = list(vgrpc.VerifierStub(ch).Session(iter(reqs), timeout=60))
    assert got[0].next_token == ref[0]
    run, after = got[1:-1], got[-1]
    assert [r.next_token for r in run] == ref[1 : k + 1]
    assert [r.more for r in run] == [True] * (k - 1) + [False]
    assert all(list(r.accepted) == [0] for r in run)
    assert after.next_token == ref[k + 1] and not after.more
    assert after.cache_tokens == len(history) + k + 1


@pytest.mark.parametrize(
    "tree, why",
    [
        (dict(tokens=[5], parents=[-1], run=-1), "at least 0"),
        (dict(tokens=[5, 6], parents=[-1, 0], run=3), "the root alone"),
        (dict(tokens=[5], parents=[-1], masks=b"\xff" * 4, run=2), "without masks"),
    ],
)
def test_a_bad_run_is_refused_with_invalid_argument(stack, tree, why):
    with backend_channel(stack.verifier_target(0)) as ch:
        reqs = [
            vpb.VerifyRequest(open=vpb.VerifierOpen(session_id="bad-run", tenant="t", history=prompt(302))),
            vpb.VerifyRequest(tree=vpb.VerifyTree(**tree)),
        ]
        with pytest.raises(grpc.RpcError) as e:
            list(vgrpc.VerifierStub(ch).Session(iter(reqs), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()


def test_the_verifiers_context_slope_reaches_the_drafter_and_prices_each_round_at_its_length(
    stack, tiny_llama, monkeypatch
):
    """The verifier measures its cost curve at two cache lengths; the gateway opens the drafter with
    the curve and what each token of context adds, and every adaptive round is priced at the
    session's length (the prompt, then every committed token)."""
    from drafter.adaptive import BudgetChooser
    from verifier.engine import COST_CONTEXTS

    core = stack.verifiers[0][1]
    assert core.slope is not None and core.slope.context == COST_CONTEXTS[0]
    seen = []
    real = BudgetChooser.choose

    def choose(self, other_rows=0, length=None, kind=None):
        seen.append((self.slope, length))
        return real(self, other_rows, length, kind)

    monkeypatch.setattr(BudgetChooser, "choose", choose)
    p = prompt(95)
    with Client(stack.gateway, timeout=60) as c:
        ids, _, _ = c.complete(p, max_new_tokens=24, budget=0)
    assert ids == hf_greedy(tiny_llama, p, 24)
    assert seen
    slope, first = seen[0]
    assert slope.context == core.slope.context
    assert [slope.ms(n, 2000) for n in core.cost] == pytest.approx([core.slope.ms(n, 2000) for n in core.cost])
    lengths = [n for _, n in seen]
    assert first == len(p) and lengths == sorted(set(lengths)) and lengths[-1] < len(p) + 24
    # The curve's running average takes each forward back to the curve's length: a slope as if the
    # curve had been measured a million tokens in makes this short session's forwards count ~1 s dearer.
    from common.costs import ContextSlope

    kept, before = core.slope, dict(core.cost)
    core.slope = ContextSlope(10**6, {n: 1e-3 for n in core.cost})
    try:
        with Client(stack.gateway, timeout=60) as c:
            c.complete(prompt(96), max_new_tokens=12, budget=4)
        risen = [n for n in core.cost if core.cost[n] > before[n] + 40]  # a forward moves its size 5% of ~1 s
        assert risen and all(core.cost[n] >= before[n] for n in core.cost), (before, core.cost)
    finally:
        core.slope = kept
        core.cost.update(before)  # the later tests' curve as it was
