"""Batched prefill: prompts of several sessions in one forward, each getting what it gets alone.

float32: token for token what each prompt gets prefilled alone (its top-k at every prompt position,
its next token, and the greedy continuation after it). Reduced precision (bfloat16, invariant
kernels): equal to the engine's own decoding without drafts (``off``) of the prompt alone.
The verifier's ``PrefillBatcher`` is driven with the model thread held by a job that waits on an
event, so the prompts surely wait together.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from tests.support.aio import until
from tests.verifier.test_batch_invariance import make_wide_llama
from verifier import batcher
from verifier.engine import VerifierSession, prefill_batch
from verifier.sessions import Open, Verifier

N = 24
LENGTHS = (3, 40, 11, 1, 25, 17)


def _prompt(i: int, n: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 96) for _ in range(n)]


def _off(v: VerifierSession, first: int, n: int = N) -> list[int]:
    """Greedy decoding without drafts: one token per forward (``--mode off``)."""
    out = [first]
    while len(out) < n:
        out.append(v.verify([out[-1]], [-1]).bonus)
    return out


def _alone(model, history: list[int], turn: list[int] | None = None):
    v = VerifierSession(model, backend="llama")
    pre = v.prefill(history)
    if turn is not None:  # a later turn: only its tokens are prefilled
        pre = v.prefill(turn)
    return pre.topk, _off(v, pre.next_token)


def _together(model, histories, turns):
    sessions = [VerifierSession(model, backend="llama") for _ in histories]
    items = []
    for v, h, t in zip(sessions, histories, turns):
        if t is not None:
            v.prefill(h)
        items.append((v, t if t is not None else h, True))
    results = prefill_batch(items)
    return [(r.topk, _off(v, r.next_token)) for v, r in zip(sessions, results)]


def _cases():
    histories = [_prompt(i, n) for i, n in enumerate(LENGTHS)]
    turns = [None, None, _prompt(50, 6), None, _prompt(51, 1), None]  # two sessions' later turns
    return histories, turns


def test_prompts_prefilled_together_equal_each_alone_in_float32(tiny_llama):
    histories, turns = _cases()
    alone = [_alone(tiny_llama, h, t) for h, t in zip(histories, turns)]
    assert _together(tiny_llama, histories, turns) == alone


@pytest.fixture(scope="module", params=["linear:4", "auto"])
def bf16_llama(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("RACER_KERNELS", request.param)  # forced 4-row chunks (prompts span chunks), and tuned
    mp.setenv("RACER_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield make_wide_llama()
    mp.undo()


def test_prompts_prefilled_together_equal_off_alone_in_bf16(bf16_llama):
    histories, turns = _cases()
    alone = [_alone(bf16_llama, h, t) for h, t in zip(histories, turns)]
    assert _together(bf16_llama, histories, turns) == alone


def test_an_invalid_prompt_fails_alone_and_leaves_the_batch_intact(tiny_llama):
    good = [_prompt(1, 9), _prompt(2, 4)]
    sessions = [VerifierSession(tiny_llama, backend="llama") for _ in range(3)]
    res = prefill_batch([(sessions[0], good[0], True), (sessions[1], [5, 10**6], True), (sessions[2], good[1], True)])
    assert isinstance(res[1], ValueError) and sessions[1].length == 0
    assert [(r.topk, _off(v, r.next_token)) for v, r in ((sessions[0], res[0]), (sessions[2], res[2]))] == [
        _alone(tiny_llama, p) for p in good
    ]


def _hold(v: Verifier):
    """Holds the model thread with a job that waits for the returned event."""
    go = threading.Event()
    v.model_thread.submit("holder", 1, "resize", go.wait)
    return go


def test_waiting_prompts_share_forwards_of_at_most_one_chunk_round_robin_across_tenants(tiny_llama, monkeypatch):
    """Eight prompts of two tenants wait behind a held model thread; with 48-token chunks and four
    prompts a forward they are prefilled in a few forwards, none over the bounds, the first holding
    both tenants' prompts; every session gets what it gets alone."""
    calls: list[list[tuple[object, int]]] = []
    real = batcher.prefill_batch

    def recorded(items):
        calls.append([(session, len(tokens)) for session, tokens, _ in items])
        return real(items)

    monkeypatch.setattr(batcher, "prefill_batch", recorded)

    async def go():
        v = Verifier(tiny_llama, backend="llama", prefill_chunk=48, prefill_batch=4, headroom=8)
        prompts = {(t, i): _prompt(10 * i + (t == "b"), 7 + 3 * i) for t in ("a", "b") for i in range(4)}
        held = _hold(v)
        entries = {k: v.claim(Open(k[0], f"s{k[1]}", p)) for k, p in prompts.items()}
        opens = [asyncio.ensure_future(v.open(entries[k], p)) for k, p in prompts.items()]
        await until(lambda: v.model_thread.pending == 1 + len(prompts))
        held.set()
        done = await asyncio.gather(*opens)
        v.close()
        return done, {e.session: k[0] for k, e in entries.items()}, prompts

    done, tenant_of, prompts = asyncio.run(asyncio.wait_for(go(), 120))
    assert sum(len(c) for c in calls) == len(prompts) and 1 < len(calls) < len(prompts)
    assert all(len(c) <= 4 and sum(n for _, n in c) <= 48 for c in calls), calls
    assert {tenant_of[s] for s, _ in calls[0]} == {"a", "b"}  # round robin: the other tenant joins first
    for p, res in zip(prompts.values(), done):
        topk, out = _alone(tiny_llama, p)
        assert res.topk == [t for row in topk for t in row] and res.next_token == out[0]
