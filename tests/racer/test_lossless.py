"""Greedy speculative decoding is lossless: ``generate`` emits exactly what transformers' own greedy
decoding emits, whatever the drafter proposes, and stops exactly where it should."""

from __future__ import annotations

import pytest

from common.params import MODES, GenerationParams
from drafter.draft_session import DraftSession
from tests.support.engine import RecordingVerifier, ScriptedDrafter, Tree, hf_greedy, run, run_racer, single_thread
from verifier.engine import VerifierSession

BACKENDS = ["llama", "hf"]
N = 32  # new tokens per prompt
EXTRA = 70  # the scripted drafters look this far ahead of the output
PROMPTS = [
    [1, 5, 9, 13, 5, 9, 13, 5, 9],  # repeated n-grams
    [1, 7],  # almost no context
    # + a prompt that already holds (a stretch of) its own continuation: retrieval drafts are right
]


@pytest.fixture(scope="module")
def refs(tiny_llama):
    """prompt -> transformers greedy output, N + EXTRA tokens (no stop token)."""
    prompts = list(PROMPTS)
    with single_thread():
        echo = [1, 7] + hf_greedy(tiny_llama, [1, 7], 30)
        prompts.append(echo)
        out = {tuple(p): hf_greedy(tiny_llama, p, N + EXTRA) for p in prompts}
    for p, r in out.items():  # the fixture model must give varied output with some repetition
        assert 5 <= len(set(r[:60])) < 60, (p, r)
    return out


def test_tiny_model_greedy_output_is_varied(tiny_llama, refs):
    distinct = [len(set(r[:60])) for r in refs.values()]
    assert min(distinct) >= 5 and max(distinct) >= 10, distinct
    # ... and repeats itself (cycles), so that retrieval and copy-logit drafts have something to find
    assert all(len(set(r[:60])) <= 40 for r in refs.values())


# -- every drafting mode and budget ------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 2, 8, 64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_output_equals_transformers_generate(tiny_llama, refs, backend, mode, budget):
    accepted = 0
    for prompt, ref in refs.items():
        out, stats, chunks = run_racer(tiny_llama, list(prompt), backend, max_new_tokens=N, mode=mode, budget=budget)
        assert out == ref[:N], f"prompt {list(prompt)}"
        assert all(chunks), "empty chunk yielded"
        assert stats.new_tokens == N
        # the first token comes from the prefill, every round adds its accepted nodes and a bonus
        # (the last round's may be cut by max_new_tokens)
        assert 1 + stats.rounds + stats.accepted >= N
        assert stats.drafted <= stats.rounds * (budget - 1)
        assert stats.accepted <= stats.drafted
        accepted += stats.accepted
        if mode == "off" or budget == 1:
            assert stats.drafted == 0 and stats.accepted == 0
            assert stats.rounds == N - 1
    if mode not in ("off", "last-logit") and budget > 1:
        assert accepted > 0, "these drafts are expected to be right sometimes (else nothing is tested)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_turn_prefill_continues_losslessly(tiny_llama, refs, backend):
    """A later turn's tokens appended with prefill on the same sessions continue exactly."""
    prompt = [1, 5, 9, 13, 5, 9, 13, 5, 9]
    drafter, verifier = DraftSession(), VerifierSession(tiny_llama, backend=backend)
    first, _, _ = run(drafter, verifier, prompt, GenerationParams(max_new_tokens=12, mode="racer", budget=16))
    assert first == refs[tuple(prompt)][:12]
    # The last round may have been cut by max_new_tokens after the verifier committed more of its
    # accepted path, and the last emitted token may be a bonus that was never fed: the caller keeps
    # prompt + output[:-1] and starts the next turn with output[-1].
    assert verifier.length >= len(prompt) + len(first) - 1
    verifier.truncate(len(prompt) + len(first) - 1)
    turn = [first[-1], 5, 9, 13]
    second, _, _ = run(drafter, verifier, turn, GenerationParams(max_new_tokens=20, mode="racer", budget=16))
    assert second == hf_greedy(tiny_llama, prompt + first + turn[1:], 20)


# -- adversarial and scripted drafters ------------------------------------------------------------------


@pytest.mark.parametrize("budget", [3, 8, 64])
@pytest.mark.parametrize("kind", ["wrong", "near", "exact", "random"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scripted_drafts_are_lossless(tiny_llama, refs, backend, kind, budget):
    vocab = tiny_llama.config.vocab_size
    for seed, (prompt, ref) in enumerate(refs.items()):
        drafter = ScriptedDrafter(list(prompt) + ref, vocab, kind, seed)
        verifier = RecordingVerifier(VerifierSession(tiny_llama, backend=backend))
        out, stats, _ = run(drafter, verifier, list(prompt), GenerationParams(max_new_tokens=N, budget=budget))
        assert out == ref[:N]
        assert len(verifier.rounds) == stats.rounds == len(drafter.expected_accepts)
        for (tokens, _, res), want in zip(verifier.rounds, drafter.expected_accepts):
            if want >= 0:
                assert len(res.accepted) - 1 == want, (kind, tokens, res.accepted)
        if kind == "wrong":
            assert stats.accepted == 0 and stats.rounds == N - 1
            if budget > 1:
                assert stats.drafted > 0
        if kind == "exact":
            assert stats.mat == budget


# -- stop tokens ------------------------------------------------------------------------------------------


def first_new_occurrence(ref, start):
    """An index k >= start whose token does not occur in ref[:k]."""
    for k in range(start, len(ref)):
        if ref[k] not in ref[:k]:
            return k
    raise AssertionError("no fresh token in the reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [4, 8])
def test_stop_token_inside_an_accepted_path(tiny_llama, refs, backend, budget):
    vocab = tiny_llama.config.vocab_size
    checked = 0
    for prompt, ref in refs.items():
        # with exact chains of `budget` nodes, round r emits ref[1 + r*budget : 1 + (r+1)*budget],
        # of which only the last is the bonus: pick a stop token that falls on an accepted node
        k = first_new_occurrence(ref, 2)
        while k % budget == 0:
            k = first_new_occurrence(ref, k + 1)
        stop = ref[k]
        drafter = ScriptedDrafter(list(prompt) + ref, vocab, "exact")
        verifier = RecordingVerifier(VerifierSession(tiny_llama, backend=backend))
        params = GenerationParams(max_new_tokens=N + 20, stop_token_ids=(stop, vocab + 5), budget=budget)
        out, stats, chunks = run(drafter, verifier, list(prompt), params)
        assert out == ref[: k + 1], "output must stop right after the stop token, which is included"
        assert out == hf_greedy(tiny_llama, list(prompt), N + 20, eos=(stop,))
        assert stats.new_tokens == k + 1
        tokens, _, res = verifier.rounds[-1]
        accepted = [tokens[i] for i in res.accepted]
        assert stop in accepted[1:], "the stop token was meant to be an accepted node, not the bonus"
        assert chunks[-1][-1] == stop
        checked += 1
    assert checked == len(refs)


@pytest.mark.parametrize("mode", ["racer", "retrieval", "pld", "off"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_token_with_real_drafts(tiny_llama, refs, backend, mode):
    for prompt, ref in refs.items():
        for k in (first_new_occurrence(ref, 1), first_new_occurrence(ref, 9)):
            stops = (ref[k], tiny_llama.config.eos_token_id)
            out, stats, _ = run_racer(
                tiny_llama, list(prompt), backend, max_new_tokens=N + 20, stop_token_ids=stops, mode=mode, budget=32
            )
            want = ref[: next(i for i, t in enumerate(ref) if t in stops) + 1]
            assert out == want
            assert stats.new_tokens == len(want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_token_from_the_prefill(tiny_llama, refs, backend):
    prompt, ref = next(iter(refs.items()))
    out, stats, _ = run_racer(tiny_llama, list(prompt), backend, max_new_tokens=10, stop_token_ids=(ref[0],))
    assert out == [ref[0]]
    assert stats.rounds == 0


# -- max_new_tokens ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 13])
@pytest.mark.parametrize("backend", BACKENDS)
def test_max_new_tokens_is_exact(tiny_llama, refs, backend, max_new):
    vocab = tiny_llama.config.vocab_size
    for prompt, ref in refs.items():
        for budget in (8, 64):  # accepted paths longer than the room left
            drafter = ScriptedDrafter(list(prompt) + ref, vocab, "exact")
            out, stats, _ = run(
                drafter,
                VerifierSession(tiny_llama, backend=backend),
                list(prompt),
                GenerationParams(max_new_tokens=max_new, budget=budget),
            )
            assert out == ref[:max_new]
            assert stats.new_tokens == max_new
        out, stats, _ = run_racer(tiny_llama, list(prompt), backend, max_new_tokens=max_new, mode="racer")
        assert out == ref[:max_new]
        assert stats.new_tokens == max_new


def test_generation_params_reject_bad_values():
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="budget"):
        GenerationParams(budget=-1)
    assert GenerationParams(budget=0).budget == 0  # adaptive


# -- the default model (slow) -----------------------------------------------------------------------------

CHAT = [
    "List the days of the week, then list them again in the same order.",
    "Count from 1 to 30.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def chat_refs(default_model):
    """chat prompt ids -> transformers greedy output (48 tokens at most, stopping at EOS)."""
    out = {}
    with single_thread():
        for text in CHAT:
            ids = default_model.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            ids = list(ids)
            out[tuple(ids)] = hf_greedy(default_model.model, ids, 48, eos=default_model.eos_token_ids)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["racer", "logits", "retrieval"])
def test_default_model_greedy_lossless(default_model, chat_refs, mode):
    accepted = 0
    for prompt, ref in chat_refs.items():
        out, stats, _ = run_racer(
            default_model.model,
            list(prompt),
            "auto",
            max_new_tokens=48,
            stop_token_ids=default_model.eos_token_ids,
            mode=mode,
            budget=16,
        )
        assert out == ref, default_model.tokenizer.decode(out)
        accepted += stats.accepted
    assert accepted > 0


# -- found bugs (xfail strict: these turn into failures once fixed) ------------------------------------------


class WrongRootDrafter:
    """Returns a tree whose root is not the token it was asked to draft from (a buggy or stale remote
    drafter); its other nodes are harmless."""

    def extend(self, tokens, topk_rows=None) -> None:
        pass

    def observe_tree(self, tree_tokens, tree_topk, accepted) -> None:
        pass

    def draft(self, root: int, budget: int, mode: str) -> Tree:
        return Tree(((root + 1) % 96,), (-1,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_with_a_wrong_root_is_rejected_or_harmless(tiny_llama, refs, backend):
    prompt, ref = next(iter(refs.items()))
    try:
        out, _, _ = run(
            WrongRootDrafter(),
            VerifierSession(tiny_llama, backend=backend),
            list(prompt),
            GenerationParams(max_new_tokens=10),
        )
    except ValueError as exc:
        assert "root" in str(exc)
    else:
        assert out == ref[:10]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verifier_holds_prompt_plus_output_but_last_after_a_normal_end(tiny_llama, refs, backend):
    for prompt, _ref in refs.items():
        verifier = VerifierSession(tiny_llama, backend=backend)
        out, _, _ = run(DraftSession(), verifier, list(prompt), GenerationParams(max_new_tokens=9, mode="off"))
        assert verifier.length == len(prompt) + len(out) - 1


@pytest.mark.parametrize("cut", ["max_new_tokens", "stop_token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_verifier_holds_prompt_plus_output_but_last_after_a_cut(tiny_llama, refs, backend, cut):
    vocab = tiny_llama.config.vocab_size
    prompt, ref = next(iter(refs.items()))
    k = first_new_occurrence(ref, 2)  # with exact chains of 8, ref[k] (k < 8) is an accepted node
    assert k < 8
    params = (
        GenerationParams(max_new_tokens=k + 1, budget=8)
        if cut == "max_new_tokens"
        else GenerationParams(max_new_tokens=N, stop_token_ids=(ref[k],), budget=8)
    )
    verifier = VerifierSession(tiny_llama, backend=backend)
    out, _, _ = run(ScriptedDrafter(list(prompt) + ref, vocab, "exact"), verifier, list(prompt), params)
    assert out == ref[: k + 1]
    assert verifier.length == len(prompt) + len(out) - 1


# -- the adaptive budget --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_costs(tiny_llama):
    from verifier.engine import measure_cost

    with single_thread():
        costs = measure_cost(tiny_llama, sizes=(1, 2, 4, 8, 16, 32), context=32, reps=1)
    assert all(c > 0 for c in costs.values())
    return costs


@pytest.mark.parametrize("costs", ["measured", "flat", "steep"])
@pytest.mark.parametrize("mode", ["racer", "retrieval", "logits", "pld", "off"])
def test_adaptive_budget_is_lossless(tiny_llama, refs, tiny_costs, mode, costs):
    curve = {
        "measured": tiny_costs,
        "flat": {1: 1.0, 8: 1.0, 32: 1.0},  # big trees free: budget 32
        "steep": {1: 1.0, 2: 5.0, 8: 50.0},
    }[costs]  # speculation never pays: budget 1
    sizes = []
    for prompt, ref in refs.items():
        drafter = DraftSession()
        drafter.set_costs(curve)
        verifier = RecordingVerifier(VerifierSession(tiny_llama, backend="llama"))
        out, stats, _ = run(drafter, verifier, list(prompt), GenerationParams(max_new_tokens=N, mode=mode, budget=0))
        assert out == ref[:N], f"prompt {list(prompt)}"
        sizes += [len(t) for t, _, _ in verifier.rounds]
    if mode == "off" or costs == "steep":
        assert set(sizes) == {1}
    elif costs == "flat" and mode in ("racer", "logits"):
        assert max(sizes) > 8
