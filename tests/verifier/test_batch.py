"""Batched verification: every session's result is what it gets alone, whatever shares its forward."""

from __future__ import annotations

import random

from common.loop import cut, generate, settle
from common.params import GenerationParams, SamplingParams
from drafter.draft_session import DraftSession
from verifier.engine import VerifierSession, verify_batch

N = 30
SPECS = [  # (prompt length, mode, budget, sampling)
    (3, "racer", 8, None),
    (40, "retrieval", 16, None),
    (11, "logits", 4, None),
    (25, "pld", 6, None),
    (7, "off", 1, None),
    (17, "racer", 12, SamplingParams(0.8, 0.9, 0, seed=5)),
    (30, "logits", 8, SamplingParams(1.0, 1.0, 20, seed=9)),
]


def _prompt(i: int, n: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 96) for _ in range(n)]


def _alone(model, prompt, mode, budget, sampling):
    v = VerifierSession(model, backend="llama", sampling=sampling or SamplingParams())
    return [
        t
        for ch in generate(DraftSession(), v, prompt, GenerationParams(max_new_tokens=N, mode=mode, budget=budget))
        for t in ch
    ]


def _lockstep(model, specs):
    """All sessions advance round by round; each round's trees go through one verify_batch."""
    state = []
    for i, (n, mode, budget, sampling) in enumerate(specs):
        prompt = _prompt(i, n)
        d, v = DraftSession(), VerifierSession(model, backend="llama", sampling=sampling or SamplingParams())
        pre = v.prefill(prompt)
        d.extend(prompt, pre.topk)
        out, done = cut([pre.next_token], set(), N)
        state.append(dict(d=d, v=v, mode=mode, budget=budget, out=list(out), done=done, root=pre.next_token))
    batches = 0
    while not all(s["done"] for s in state):
        live = [s for s in state if not s["done"]]
        trees = [s["d"].draft(s["root"], s["budget"], s["mode"]) for s in live]
        results = verify_batch([(s["v"], list(t.tokens), list(t.parents)) for s, t in zip(live, trees)])
        batches += len(live) > 1
        for s, t, res in zip(live, trees, results):
            path = [t.tokens[i] for i in res.accepted]
            out, fed, done = settle(path, res.bonus, set(), N - len(s["out"]))
            if len(fed) < len(path):
                s["v"].truncate(s["v"].length - (len(path) - len(fed)))
            s["d"].observe_tree(t.tokens, res.topk, res.accepted)
            s["d"].extend(fed)
            s["out"] += out
            s["done"] = done
            s["root"] = out[-1] if out else res.bonus
    assert batches > 5, "the sessions never shared a forward"
    return [s["out"] for s in state]


def test_batched_sessions_produce_what_they_produce_alone(tiny_llama):
    alone = [_alone(tiny_llama, _prompt(i, n), mode, budget, sp) for i, (n, mode, budget, sp) in enumerate(SPECS)]
    assert _lockstep(tiny_llama, SPECS) == alone


def test_an_invalid_tree_fails_alone_and_leaves_the_batch_intact(tiny_llama):
    a, b = VerifierSession(tiny_llama, backend="llama"), VerifierSession(tiny_llama, backend="llama")
    solo = VerifierSession(tiny_llama, backend="llama")
    for s in (a, b, solo):
        s.prefill([5, 6, 7, 8])
    res = verify_batch([(a, [9, 10, 11], [-1, 0, 5]), (b, [9, 10, 11], [-1, 0, 1])])
    assert isinstance(res[0], ValueError) and "parents[2]" in str(res[0])
    assert a.length == 4  # untouched
    expect = solo.verify([9, 10, 11], [-1, 0, 1])
    assert (res[1].accepted, res[1].bonus, res[1].topk) == (expect.accepted, expect.bonus, expect.topk)
    assert b.length == solo.length


def test_hf_backend_sessions_fall_back_to_one_forward_each(tiny_llama):
    a = VerifierSession(tiny_llama, backend="hf")
    b = VerifierSession(tiny_llama, backend="llama")
    ref = VerifierSession(tiny_llama, backend="llama")
    for s in (a, b, ref):
        s.prefill([5, 6, 7])
    res = verify_batch([(a, [8, 9], [-1, 0]), (b, [8, 9], [-1, 0])])
    expect = ref.verify([8, 9], [-1, 0])
    assert res[0].accepted == res[1].accepted == expect.accepted and res[0].bonus == res[1].bonus == expect.bonus
