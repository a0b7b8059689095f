"""verifier/acceptance.py: the longest path the target agrees with, and the bonus token."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verifier.acceptance import accept
from verifier.engine import VerifierSession

VOCAB = 6  # small, so guesses are often right and duplicate siblings happen


@st.composite
def trees_and_targets(draw, max_nodes: int = 20):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    target = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))  # choice at each node
    return tokens, parents, target


def path_to(parents, i) -> list[int]:
    out = []
    while i != -1:
        out.append(i)
        i = parents[i]
    return out[::-1]


def brute_force_accept(tokens, parents, target) -> tuple[list[int], int]:
    """Every root-to-node path whose each token equals the target's choice at its parent; the longest
    one wins; among equally long ones (only possible through duplicate siblings) the one that takes
    the lowest-indexed sibling first at the first divergence (the documented tie rule)."""
    matching = []
    for i in range(len(tokens)):
        p = path_to(parents, i)
        if all(tokens[c] == target[a] for a, c in zip(p, p[1:])):
            matching.append(p)

    # an accepted path cannot stop early when its last node has a matching child, so "longest" and
    # "the walk never skips an agreeing child" coincide; the tie rule picks the first sibling.
    def canonical(p):
        return all(
            min(j for j in range(1, len(tokens)) if parents[j] == a and tokens[j] == tokens[c]) == c
            for a, c in zip(p, p[1:])
        )

    canon = [p for p in matching if canonical(p)]
    best = max(canon, key=len)
    assert sum(len(p) == len(best) for p in canon) == 1
    return best, target[best[-1]]


@given(trees_and_targets())
@settings(max_examples=200, deadline=None)
def test_accept_is_the_longest_agreeing_path_and_the_bonus_follows_it(case):
    tokens, parents, target = case
    calls = []

    def choose(i):
        calls.append(i)
        return target[i]

    path, bonus = accept(tokens, parents, choose)
    want_path, want_bonus = brute_force_accept(tokens, parents, target)
    assert path == want_path
    assert bonus == want_bonus
    # the target is asked exactly once per accepted node, root first: with sampling these are the
    # very same draws, in the same order, as plain token-by-token sampling
    assert calls == path


@given(trees_and_targets())
@settings(max_examples=100, deadline=None)
def test_accept_without_duplicate_siblings_takes_the_deepest_agreeing_node(case):
    tokens, parents, target = case
    seen = set()
    for i in range(1, len(tokens)):  # drop duplicate siblings by renaming them out of the vocabulary
        while (parents[i], tokens[i]) in seen:
            tokens[i] += VOCAB
        seen.add((parents[i], tokens[i]))
    path, bonus = accept(tokens, parents, target.__getitem__)
    agreeing = [
        p
        for p in (path_to(parents, i) for i in range(len(tokens)))
        if all(tokens[c] == target[a] for a, c in zip(p, p[1:]))
    ]
    longest = max(len(p) for p in agreeing)
    assert [p for p in agreeing if len(p) == longest] == [path]
    assert bonus == target[path[-1]]


def test_accept_examples():
    # root 9 -> (4 -> 5 -> 6), (4? no: 7), second branch 3 -> 8
    tokens = [9, 4, 3, 5, 8, 6]
    parents = [-1, 0, 0, 1, 2, 3]
    assert accept(tokens, parents, {0: 4, 1: 5, 3: 6, 5: 1}.__getitem__) == ([0, 1, 3, 5], 1)
    assert accept(tokens, parents, {0: 3, 2: 8, 4: 0}.__getitem__) == ([0, 2, 4], 0)
    assert accept(tokens, parents, {0: 4, 1: 0}.__getitem__) == ([0, 1], 0)
    assert accept(tokens, parents, {0: 2}.__getitem__) == ([0], 2)
    assert accept([9], [-1], {0: 9}.__getitem__) == ([0], 9)  # a single node: only the bonus
    # duplicate siblings: the first one wins even when the second would lead further
    assert accept([0, 1, 1, 2], [-1, 0, 0, 2], {0: 1, 1: 7, 2: 2}.__getitem__) == ([0, 1], 7)


@given(trees_and_targets())
@settings(max_examples=100, deadline=None)
def test_all_wrong_guesses_accept_only_the_root(case):
    tokens, parents, target = case
    wrong = [tokens[0]] + [(target[parents[i]] + 1 + tokens[i] % (VOCAB - 1)) % VOCAB for i in range(1, len(tokens))]
    assert all(wrong[i] != target[parents[i]] for i in range(1, len(tokens)))
    assert accept(wrong, parents, target.__getitem__) == ([0], target[0])


# -- greedy acceptance through the verifier on the tiny model ---------------------------------------------


@torch.inference_mode()
def argmax_after(model, seq) -> int:
    return int(model(torch.tensor([seq])).logits[0, -1].argmax())


@pytest.mark.parametrize("backend", ["llama", "hf"])
@pytest.mark.parametrize("seed", range(4))
def test_verify_greedy_matches_brute_force_argmax(tiny_llama, backend, seed):
    model = tiny_llama
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    context = [rng.randrange(vocab) for _ in range(rng.randint(2, 9))]
    session = VerifierSession(model, backend=backend)
    root = session.prefill(context).next_token
    assert root == argmax_after(model, context)
    # a tree that mixes the target's real choices with guesses: each node gets up to 3 children, the
    # first being the argmax with probability 0.6, the rest random
    tokens, parents = [root], [-1]
    frontier = [0]
    while frontier and len(tokens) < 20:
        node = frontier.pop(0)
        path = path_to(parents, node)
        best = argmax_after(model, context + [tokens[i] for i in path])
        kids = {best} if rng.random() < 0.6 else set()
        kids |= {rng.randrange(vocab) for _ in range(rng.randint(0, 2))}
        for t in sorted(kids, key=lambda _: rng.random()):
            if len(tokens) < 20:
                tokens.append(t)
                parents.append(node)
                frontier.append(len(tokens) - 1)
    target = [argmax_after(model, context + [tokens[i] for i in path_to(parents, i)]) for i in range(len(tokens))]
    want_path, want_bonus = brute_force_accept(tokens, parents, target)
    res = session.verify(tokens, parents)
    assert res.accepted == want_path
    assert res.bonus == want_bonus
    assert session.length == len(context) + len(want_path)


@pytest.mark.parametrize("backend", ["llama", "hf"])
def test_verify_tree_of_wrong_guesses_accepts_only_the_root(tiny_llama, backend):
    model = tiny_llama
    vocab = model.config.vocab_size
    context = [1, 17, 23, 17, 23, 5]
    session = VerifierSession(model, backend=backend)
    root = session.prefill(context).next_token
    right = argmax_after(model, context + [root])
    tokens, parents = [root], [-1]
    for t in range(vocab):  # every wrong token under the root, then wrong grandchildren
        if t != right and len(tokens) < 40:
            tokens.append(t)
            parents.append(0)
    for child in range(1, 6):
        child_right = argmax_after(model, context + [root, tokens[child]])
        tokens.append((child_right + 1) % vocab)
        parents.append(child)
    res = session.verify(tokens, parents)
    assert res.accepted == [0]
    assert res.bonus == right
    assert session.length == len(context) + 1
