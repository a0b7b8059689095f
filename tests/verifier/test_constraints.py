"""Masks, logit_bias and penalties per tree node, and log-probabilities, against one-token decoding:
a tree verified in one forward emits the tokens, with the log-probabilities bit for bit (reduced
precision), that feeding the same path one token at a time does, each position with the mask and
penalties of its own path."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.verifier.test_batch_invariance import VOCAB, make_wide_llama
from verifier.constraints import Adjust, unpack, words
from verifier.engine import VerifierSession


def _mask(prefix: tuple[int, ...]) -> torch.Tensor:
    """A pseudo-random allowed set that depends on the generated tokens before a position."""
    rng = np.random.default_rng(abs(hash(prefix)) % (2**32))
    allowed = rng.random(VOCAB) < 0.4
    allowed[rng.integers(VOCAB)] = True
    return torch.from_numpy(allowed)


def _session(model, adjust, logprobs=3):
    s = VerifierSession(model, topk=4)
    s.logprobs, s.adjust = logprobs, adjust
    return s


@pytest.fixture(scope="module")
def bf16():
    return make_wide_llama(seed=3, dtype=torch.bfloat16)


@pytest.mark.parametrize("seed", range(4))
def test_tree_rows_with_masks_and_penalties_equal_one_token_steps(bf16, seed):
    _compare(bf16, seed, blind=False)


def test_rows_masked_by_the_roots_state_alone_do_not(bf16):
    """Negative control: every node given the root's mask (blind to its own path's state)."""
    with pytest.raises(AssertionError):
        for seed in range(4):
            _compare(bf16, seed, blind=True)


def _compare(bf16, seed: int, blind: bool) -> None:
    rng = random.Random(seed)
    adjust = Adjust.of({rng.randrange(VOCAB): 3.0, rng.randrange(VOCAB): -5.0}, 0.4, 0.6, VOCAB)
    prompt = [rng.randrange(3, VOCAB) for _ in range(12)]
    tree_s, step_s = _session(bf16, adjust), _session(bf16, adjust)
    for s in (tree_s, step_s):
        s.open_mask = _mask(())
        first = s.prefill(prompt)
    root = first.next_token
    generated = [root]
    # the tree: the one-token path as its first branch (so it is accepted), random other nodes
    path, s_root = [], root
    step_lp = []
    for _ in range(5):  # one-token decoding: each step's mask from the path before it
        step_s.masks = _mask(tuple(generated + path))[None]
        r = step_s.verify([s_root], [-1])
        step_lp.append((r.bonus, r.logprobs.chosen[0], r.logprobs.top_ids[0], r.logprobs.top[0]))
        path.append(r.bonus)
        s_root = r.bonus
    tokens, parents = [root] + path[:-1], [-1] + list(range(4))
    for _ in range(6):
        tokens.append(rng.randrange(3, VOCAB))
        parents.append(rng.randrange(len(tokens) - 1))
    prefixes = []
    for i in range(len(tokens)):
        chain, j = [], i
        while j >= 0:
            chain.append(tokens[j])
            j = parents[j]
        prefixes.append(tuple(chain[::-1]))
    tree_s.masks = torch.stack([_mask(prefixes[0] if blind else p) for p in prefixes])
    res = tree_s.verify(tokens, parents)
    emitted = [tokens[i] for i in res.accepted[1:]] + [res.bonus]
    assert emitted == path[: len(emitted)] and len(emitted) == 5  # the whole path, then the bonus
    got = list(zip(emitted, res.logprobs.chosen, res.logprobs.top_ids, res.logprobs.top))
    assert got == step_lp  # bit for bit: float equality of every value
    assert all(top == sorted(top, reverse=True) for *_, top in got)


def test_float32_logprobs_agree_within_rounding():
    """float32 (no batch-invariant kernels): the bound the API states, 1e-5 on a log-probability."""
    model = make_wide_llama(seed=5, dtype=torch.float32)
    a, b = _session(model, None, 0), _session(model, None, 0)
    prompt = list(range(10, 30))
    ra = a.prefill(prompt)
    b.prefill(prompt)
    root = ra.next_token
    steps = []
    for _ in range(4):
        r = b.verify([root], [-1])
        steps.append((r.bonus, r.logprobs.chosen[0]))
        root = r.bonus
    res = a.verify([ra.next_token] + [t for t, _ in steps[:3]], [-1, 0, 1, 2])
    assert [res.bonus] == [steps[3][0]] and res.accepted == [0, 1, 2, 3]
    assert res.logprobs.chosen == pytest.approx([v for _, v in steps], abs=1e-5)


def test_unpack_reads_the_bitmask_format_and_refuses_a_wrong_size():
    allowed = np.zeros((2, VOCAB), bool)
    allowed[0, [0, 5, 95]] = True
    allowed[1, 40:60] = True
    packed = np.packbits(np.pad(allowed, ((0, 0), (0, words(VOCAB) * 32 - VOCAB))), axis=1, bitorder="little")
    got = unpack(packed.tobytes(), 2, VOCAB)
    assert torch.equal(got, torch.from_numpy(allowed))
    with pytest.raises(ValueError):
        unpack(packed.tobytes()[:-1], 2, VOCAB)
    assert unpack(b"", 2, VOCAB) is None
