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
        items.append((v, t if t is not None else h, True, None))
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
    res = prefill_batch(
        [(sessions[0], good[0], True, None), (sessions[1], [5, 10**6], True, None), (sessions[2], good[1], True, None)]
    )
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
        calls.append([(session, len(tokens)) for session, tokens, *_ in items])
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


def _head_rows(monkeypatch) -> list[int]:
    """Rows each call of the llama backend's output layer gets, from now on."""
    from verifier.llama import LlamaBackend

    rows: list[int] = []
    real = LlamaBackend.logits

    def counted(self, hidden):
        rows.append(hidden.shape[0])
        return real(self, hidden)

    monkeypatch.setattr(LlamaBackend, "logits", counted)
    return rows


@pytest.mark.parametrize("top", [0, 1, 5, 100])
def test_a_prompt_gets_the_top_k_of_its_last_rows_and_the_head_runs_over_those_rows_only(tiny_llama, monkeypatch, top):
    """``topk_rows``: the last rows of what every row gets, the same next token; the output layer runs
    over those rows (at least the last one, whose logits pick the token), not over the prompt."""
    prompt = _prompt(7, 40)
    ref = VerifierSession(tiny_llama, backend="llama")
    full = ref.prefill(prompt)
    rows = _head_rows(monkeypatch)
    v = VerifierSession(tiny_llama, backend="llama")
    res = v.prefill(prompt, topk_rows=top)
    kept = min(top, len(prompt))
    assert res.topk == (full.topk[-kept:] if kept else []) and res.next_token == full.next_token
    assert sum(rows) == max(1, kept)
    assert _off(v, res.next_token) == _off(ref, full.next_token)  # the cache holds the whole prompt
    rows.clear()
    assert v.prefill(_prompt(8, 9), choose=False, topk_rows=0) == type(res)(-1, []) and rows == []


def test_prompts_of_a_batch_share_one_output_layer_over_their_last_rows(tiny_llama, monkeypatch):
    """Batched, each prompt still gets what it gets alone with its own ``topk_rows``; the head runs
    once, over each prompt's needed rows together."""
    prompts = [_prompt(i, n) for i, n in enumerate(LENGTHS)]
    tops = [0, 3, None, 1, 2, 0]
    alone = [VerifierSession(tiny_llama, backend="llama").prefill(p, True, t) for p, t in zip(prompts, tops)]
    rows = _head_rows(monkeypatch)
    sessions = [VerifierSession(tiny_llama, backend="llama") for _ in prompts]
    together = prefill_batch([(s, p, True, t) for s, p, t in zip(sessions, prompts, tops)])
    assert [(r.next_token, r.topk) for r in together] == [(r.next_token, r.topk) for r in alone]
    want = [max(1, len(p) if t is None else min(t, len(p))) for p, t in zip(prompts, tops)]
    assert rows == [sum(want)]


@pytest.mark.parametrize("top", [0, 5, 12, None])
def test_an_open_sends_the_top_k_of_the_prompts_last_positions_across_chunks(tiny_llama, top):
    """``prompt_topk``: an open of a 30-token prompt in 8-token chunks sends back the top-k rows of
    its last ``prompt_topk`` positions (some in earlier chunks), what a whole prefill gets there."""
    prompt = _prompt(9, 30)
    full = VerifierSession(tiny_llama, backend="llama").prefill(prompt)

    async def go():
        v = Verifier(tiny_llama, backend="llama", prefill_chunk=8, headroom=8, prompt_topk=top)
        e = v.claim(Open("t", "s", prompt))
        try:
            return await v.open(e, prompt)
        finally:
            v.close()

    res = asyncio.run(asyncio.wait_for(go(), 120))
    kept = full.topk if top is None else full.topk[len(prompt) - top :]
    assert res.topk == [t for row in kept for t in row] and res.next_token == full.next_token


def _shared(n_prefix: int, tails: list[int]) -> list[list[int]]:
    """Prompts that begin with the same ``n_prefix`` tokens (a chat template's system prompt)."""
    head = _prompt(60, n_prefix)
    return [head + _prompt(70 + i, n) for i, n in enumerate(tails)]


def _rows_computed(monkeypatch) -> list[list[int]]:
    """Rows of each segment of every forward the engine runs, from now on."""
    from verifier import engine

    calls: list[list[int]] = []
    real = engine.forward_segments

    def recorded(segments, rows_exact=True):
        calls.append([seg[1].shape[0] for seg in segments])
        return real(segments, rows_exact)

    monkeypatch.setattr(engine, "forward_segments", recorded)
    return calls


def test_prompts_of_a_batch_with_a_common_prefix_compute_it_once_and_get_what_each_gets_alone(tiny_llama, monkeypatch):
    """float32: fresh prompts beginning with the same 20 tokens prefill those once (one forward of
    the prefix, then every prompt's own rest; a prompt that is the prefix itself keeps its last token
    to itself), and the output layer runs over the prefix's rows once; each gets its top-k rows,
    next token and greedy continuation as alone. A prompt with another beginning and a later turn
    are prefilled whole."""
    prompts = _shared(20, [5, 1, 12, 0])
    other = _prompt(80, 30)
    histories = [*prompts, other, prompts[0]]
    turns = [None, None, None, None, None, _prompt(81, 25)]  # the last: a later turn, not fresh
    alone = [_alone(tiny_llama, h, t) for h, t in zip(histories, turns)]
    sessions = [VerifierSession(tiny_llama, backend="llama") for _ in histories]
    sessions[-1].prefill(histories[-1])
    calls, head = _rows_computed(monkeypatch), _head_rows(monkeypatch)
    items = [(v, t if t is not None else h, True, None) for v, h, t in zip(sessions, histories, turns)]
    results = prefill_batch(items)
    assert calls == [[19], [6, 2, 13, 1, 30, 25]]  # the prefix once, less the last token of the one it is all of
    assert head == [19 + 6 + 2 + 13 + 1 + 30 + 25]  # the output layer too: the prefix's rows once
    assert [(r.topk, _off(v, r.next_token)) for v, r in zip(sessions, results)] == alone


def test_a_common_prefix_is_not_shared_in_reduced_precision(bf16_llama, monkeypatch):
    """bfloat16: a prompt's rows never depend on what shares its batch, so prompts with a common
    beginning are prefilled whole, each equal to ``off`` alone."""
    prompts = _shared(20, [5, 1, 12])
    alone = [_alone(bf16_llama, p) for p in prompts]
    calls = _rows_computed(monkeypatch)
    sessions = [VerifierSession(bf16_llama, backend="llama") for _ in prompts]
    results = prefill_batch([(v, p, True, None) for v, p in zip(sessions, prompts)])
    assert calls == [[25, 21, 32]]
    assert [(r.topk, _off(v, r.next_token)) for v, r in zip(sessions, results)] == alone


def test_prompts_reaching_back_into_a_common_prefix_from_different_rows_send_its_rows_through_the_head_once(
    tiny_llama, monkeypatch
):
    """float32: prompts of one shared prefix whose ``topk_rows`` reach back into it from different
    rows (4, 5 and 3 of its 20; one not at all) get the rows they get alone, and the output layer
    runs over one slice of the prefix, from the earliest row any of them needs (its last 5), not
    over a slice per prompt."""
    prompts = _shared(20, [5, 1, 12, 3])
    tops = [9, 6, 15, 2]
    alone = []
    for p, t in zip(prompts, tops):
        v = VerifierSession(tiny_llama, backend="llama")
        res = v.prefill(p, True, t)
        alone.append((res.topk, _off(v, res.next_token)))
    sessions = [VerifierSession(tiny_llama, backend="llama") for _ in prompts]
    calls, head = _rows_computed(monkeypatch), _head_rows(monkeypatch)
    results = prefill_batch([(s, p, True, t) for s, p, t in zip(sessions, prompts, tops)])
    assert calls == [[20], [5, 1, 12, 3]]  # the prefix was shared
    assert head == [5 + 5 + 1 + 12 + 2]  # the prefix's last 5 rows once, then each prompt's own
    assert [(r.topk, _off(v, r.next_token)) for v, r in zip(sessions, results)] == alone
