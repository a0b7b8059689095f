"""Sampling through speculative decoding: the same draws as plain sampling, the exact target
distribution, the filters' supports, and parameter validation.

No scipy here: chi-square critical values (upper 0.1 % points, scipy.stats.chi2.ppf(0.999, df))
are hard-coded from a table.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
import torch

from common.params import GenerationParams, SamplingParams
from drafter.draft_session import DraftSession
from tests.support.engine import Tree, hf_greedy, run, single_thread
from verifier.engine import VerifierSession
from verifier.sampling import Sampler, processed_probs

CHI2_999 = {  # df -> upper 0.1 % point of the chi-square distribution
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
    10: 29.588,
    30: 59.703,
}


def chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


class TopKTreeDrafter:
    """Drafts the target's own most likely tokens: the root's top ``widths[0]`` children, each with
    its top ``widths[1]`` children, ... (computed with transformers, memoised per context). A tree
    full of likely tokens makes the sampling walk descend often."""

    def __init__(self, model, widths=(4, 3)):
        self.model = model
        self.widths = widths
        self.history: list[int] = []

        @lru_cache(maxsize=None)
        def top(ctx: tuple[int, ...], k: int) -> tuple[int, ...]:
            with torch.inference_mode():
                return tuple(torch.topk(self.model(torch.tensor([ctx])).logits[0, -1], k).indices.tolist())

        self.top = top

    def extend(self, tokens, topk_rows=None) -> None:
        self.history += list(tokens)

    def observe_tree(self, tree_tokens, tree_topk, accepted) -> None:
        pass

    def draft(self, root: int, budget: int, mode: str) -> Tree:
        tokens, parents = [root], [-1]
        level = [(0, (*self.history, root))]
        for width in self.widths:
            nxt = []
            for node, ctx in level:
                for t in self.top(ctx, width):
                    if len(tokens) >= budget:
                        break
                    tokens.append(t)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, (*ctx, t)))
            level = nxt
        return Tree(tuple(tokens), tuple(parents))


@pytest.fixture(scope="module")
def echo_prompt(tiny_llama):
    """A prompt that holds a stretch of its own greedy continuation (retrieval drafts get accepted)."""
    with single_thread():
        return [1, 7] + hf_greedy(tiny_llama, [1, 7], 30)


# -- (a) the acceptance walk makes the same draws as plain sampling ---------------------------------------

SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=12),
    SamplingParams(temperature=0.8, top_p=0.8),
    SamplingParams(temperature=0.3, top_k=5, top_p=0.95),
]


@pytest.mark.parametrize("sp", SETTINGS, ids=lambda sp: f"t{sp.temperature}-k{sp.top_k}-p{sp.top_p}")
@pytest.mark.parametrize("backend, mode", [("llama", "racer"), ("llama", "topk-tree"), ("hf", "topk-tree")])
def test_same_seed_same_tokens_as_plain_sampling(tiny_llama, echo_prompt, backend, mode, sp):
    """``topk-tree`` drafts the target's own likely tokens, so the walk descends often."""
    accepted = 0
    for seed in range(2):
        for prompt in ([1, 5, 9, 13, 5, 9, 13, 5, 9], echo_prompt):
            params = SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed=seed)
            plain, _, _ = run(
                DraftSession(),
                VerifierSession(tiny_llama, backend=backend, sampling=params),
                prompt,
                GenerationParams(max_new_tokens=24, mode="off"),
            )
            drafter = TopKTreeDrafter(tiny_llama) if mode == "topk-tree" else DraftSession()
            spec, stats, _ = run(
                drafter,
                VerifierSession(tiny_llama, backend=backend, sampling=params),
                prompt,
                GenerationParams(max_new_tokens=24, mode="racer" if mode == "topk-tree" else mode, budget=16),
            )
            assert spec == plain, (seed, prompt)
            accepted += stats.accepted
    assert accepted > 0, "the walk never descended: nothing was tested"


@torch.inference_mode()
def _seeded_reference(model, prompt: list[int], n: int, seed: int) -> list[int]:
    """Plain sampling from transformers' logits, one draw per token from a generator seeded with
    ``seed``: what a seeded request must produce (the verifier's walk draws once per emitted token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(torch.multinomial(logits.float().softmax(-1), 1, generator=gen)))
    return ids[len(prompt) :]


def test_a_seed_gives_its_own_draws_and_different_seeds_differ(tiny_llama):
    """Fails if the seed is ignored (an unseeded generator does not repeat the reference's draws)
    or if every seed gives the same tokens."""
    outs = set()
    for seed in range(4):
        sp = SamplingParams(temperature=1.0, seed=seed)
        out, _, _ = run(
            DraftSession(), VerifierSession(tiny_llama, sampling=sp), [1, 7], GenerationParams(max_new_tokens=12)
        )
        assert out == _seeded_reference(tiny_llama, [1, 7], 12, seed), f"seed {seed}"
        outs.add(tuple(out))
    assert len(outs) == 4


# -- (b) the distribution of the emitted tokens is exactly the target's ---------------------------------------

PROMPT = [1, 5, 9, 13, 5, 9]
SAMPLES = 1500


@pytest.fixture(scope="module")
def exact_joint(tiny_llama):
    """P(t1), P(t1, t2), P(t1, t2, t3) after PROMPT at temperature 1, from transformers' softmax."""
    model = tiny_llama
    v = model.config.vocab_size
    with single_thread(), torch.inference_mode():
        p1 = model(torch.tensor([PROMPT])).logits[0, -1].double().softmax(-1)
        p2 = model(torch.tensor([PROMPT + [a] for a in range(v)])).logits[:, -1].double().softmax(-1)
        seqs = torch.tensor([PROMPT + [a, b] for a in range(v) for b in range(v)])
        p3 = model(seqs).logits[:, -1].double().softmax(-1).view(v, v, v)
    j12 = p1[:, None] * p2
    j123 = j12[:, :, None] * p3
    return p1, p2, p3, j12, j123


@pytest.fixture(scope="module")
def sampled_triples(tiny_llama):
    """SAMPLES runs of generate (racer loop, a tree of likely tokens), one seed each: first 3 tokens."""
    drafter_cache = TopKTreeDrafter(tiny_llama)
    session = VerifierSession(tiny_llama, backend="llama")
    out = []
    descended = 0
    with single_thread():
        for seed in range(SAMPLES):
            session.truncate(0)
            session.set_sampling(SamplingParams(temperature=1.0, seed=seed))
            drafter = TopKTreeDrafter(tiny_llama)
            drafter.top = drafter_cache.top  # share the memoised top-k across runs
            toks, stats, chunks = run(drafter, session, PROMPT, GenerationParams(max_new_tokens=3, budget=64))
            assert len(toks) == 3
            descended += len(chunks) > 1 and len(chunks[1]) > 1  # t3 came from a child node
            out.append(tuple(toks))
    return out, descended


def binned(counts: dict, probs: torch.Tensor, n_bins: int):
    """The n_bins most likely outcomes and one bin for the rest: observed and expected counts."""
    flat = probs.flatten()
    top = torch.topk(flat, n_bins).indices.tolist()
    shape = probs.shape
    keys = [tuple(np.unravel_index(i, shape)) for i in top]
    total = sum(counts.values())
    obs = [counts.get(k, 0) for k in keys]
    exp = [float(flat[i]) * total for i in top]
    obs.append(total - sum(obs))
    exp.append(total - sum(exp))
    return np.array(obs, float), np.array(exp, float)


def test_first_tokens_follow_the_exact_target_distribution(sampled_triples, exact_joint):
    triples, descended = sampled_triples
    p1, p2, p3, j12, j123 = exact_joint
    assert descended > SAMPLES // 4, f"the walk descended into the tree only {descended} times"
    pairs: dict = {}
    full: dict = {}
    for t in triples:
        pairs[t[:2]] = pairs.get(t[:2], 0) + 1
        full[t] = full.get(t, 0) + 1
    for counts, probs, wrong in (
        # (t1, t2); the wrong model: t2 drawn from the prompt's row again (stale logits)
        (pairs, j12, p1[:, None] * p1[None, :]),
        # (t1, t2, t3); the wrong model: t3 drawn from the root's row (the parent's logits)
        (full, j123, j12[:, :, None] * p2[:, None, :]),
    ):
        obs, exp = binned(counts, probs, 30)
        assert exp.min() >= 5, "too few samples per bin for the chi-square approximation"
        stat = chi_square(obs, exp)
        assert stat < CHI2_999[30], f"chi-square {stat:.1f} >= {CHI2_999[30]} (df 30)"
        # the same samples clearly reject a plausible bug: the test has power
        wobs, wexp = binned(counts, wrong, 30)
        assert chi_square(wobs, np.maximum(wexp, 1e-9)) > 3 * CHI2_999[30]


def test_sampler_draws_follow_processed_probs():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.9])
    for sp in (SamplingParams(temperature=0.7, top_k=4, seed=0), SamplingParams(temperature=1.3, top_p=0.9, seed=1)):
        probs = processed_probs(logits, sp)
        sampler = Sampler(sp)
        n = 3000
        counts = np.bincount([sampler(logits) for _ in range(n)], minlength=len(logits))
        support = (probs > 0).numpy()
        assert 3 <= support.sum() < len(logits), "the filter should drop some tokens, keep several"
        assert counts[~support].sum() == 0
        stat = chi_square(counts[support], probs.numpy()[support] * n)
        assert stat < CHI2_999[int(support.sum()) - 1], stat
        # power: the unfiltered tempered softmax is rejected by the same draws
        plain = torch.softmax(logits / sp.temperature, -1).numpy()
        assert chi_square(counts, plain * n) > CHI2_999[len(logits) - 1]


def test_seeded_sampler_is_reproducible():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    a = Sampler(SamplingParams(temperature=1.0, seed=123))
    b = Sampler(SamplingParams(temperature=1.0, seed=123))
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]
    Sampler(SamplingParams(temperature=1.0))(logits)  # no seed: works


# -- filters ----------------------------------------------------------------------------------------------


def reference_support(logits: torch.Tensor, sp: SamplingParams) -> set[int]:
    """The tokens temperature + top-k + top-p may emit, computed independently (numpy, float64)."""
    x = logits.double().numpy() / sp.temperature
    order = np.argsort(-x, kind="stable")
    keep = order if not sp.top_k else order[: sp.top_k]
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    if sp.top_p < 1.0:
        before = np.cumsum(p) - p  # mass of the more likely tokens
        keep = keep[before < sp.top_p]
    return set(keep.tolist())


def test_processed_probs_matches_the_reference_support():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(40, generator=g) * 3
        sp = SamplingParams(
            temperature=float(torch.rand(1, generator=g)) * 2 + 0.05,
            top_k=int(torch.randint(0, 10, (1,), generator=g)),
            top_p=float(torch.rand(1, generator=g)) * 0.99 + 0.01,
        )
        probs = processed_probs(logits, sp)
        assert abs(float(probs.sum()) - 1) < 1e-5
        assert set(torch.nonzero(probs).flatten().tolist()) == reference_support(logits, sp), sp
        # inside the support: the tempered softmax, renormalised
        s = sorted(reference_support(logits, sp))
        want = torch.softmax(logits[s].double() / sp.temperature, -1)
        torch.testing.assert_close(probs[s].double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.5, top_p=0.6),
        SamplingParams(temperature=2.0, top_k=10, top_p=0.5),
    ],
    ids=["top_k=3", "top_p=0.6", "top_k=10,top_p=0.5"],
)
@pytest.mark.parametrize("backend", ["llama", "hf"])
def test_filtered_sampling_never_leaves_the_allowed_set(tiny_llama, echo_prompt, backend, sp):
    emitted_outside_top1 = 0
    for seed in range(4):
        prompt = echo_prompt if seed % 2 else [1, 5, 9, 13, 5, 9]
        params = SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed=seed)
        drafter = TopKTreeDrafter(tiny_llama, widths=(6, 2)) if seed % 3 == 0 else DraftSession()
        out, _, _ = run(
            drafter,
            VerifierSession(tiny_llama, backend=backend, sampling=params),
            prompt,
            GenerationParams(max_new_tokens=20, budget=24),
        )
        with torch.inference_mode():
            logits = tiny_llama(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
        for i, t in enumerate(out):
            allowed = reference_support(logits[i], sp)
            assert t in allowed, (seed, i, t, sorted(allowed))
            emitted_outside_top1 += t != int(logits[i].argmax())
    assert emitted_outside_top1 > 0, "the filters were never put to the test"


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)])
def test_a_single_allowed_token_is_greedy(tiny_llama, echo_prompt, sp):
    greedy, _, _ = run(DraftSession(), VerifierSession(tiny_llama), echo_prompt, GenerationParams(max_new_tokens=20))
    for seed in range(2):
        params = SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed=seed)
        out, _, _ = run(
            DraftSession(),
            VerifierSession(tiny_llama, sampling=params),
            echo_prompt,
            GenerationParams(max_new_tokens=20),
        )
        assert out == greedy


# -- SamplingParams validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": -math.inf}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_p=1.0, top_k=0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    SamplingParams(temperature=1.0, top_p=1e-9, top_k=100_000)


@pytest.mark.parametrize("temperature", [1e-38, 1e-40])
def test_tiny_temperature_is_a_valid_distribution(temperature):
    logits = torch.tensor([5.0, 3.0, -2.0])
    sp = SamplingParams(temperature=temperature, seed=0)
    probs = processed_probs(logits, sp)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-6
    assert Sampler(sp)(logits) == 0
