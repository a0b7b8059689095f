"""verifier/tree.py: validation, depths, tree attention inputs, child index (pure functions)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verifier.tree import InvalidTree, child_index, depths, tree_inputs, validate

VOCAB = 50


@st.composite
def trees(draw, max_nodes: int = 24, vocab: int = VOCAB):
    """(tokens, parents): parents[0] == -1 and parents[i] in [0, i)."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return tokens, parents


def ancestors(parents, i) -> set[int]:
    """Brute force: i and every node on the way to the root."""
    out = set()
    while i != -1:
        assert i not in out, "cycle in a test tree"
        out.add(i)
        i = parents[i]
    return out


# -- validate ----------------------------------------------------------------------------------------


@given(trees())
@settings(max_examples=100, deadline=None)
def test_validate_accepts_every_topologically_ordered_tree(tree):
    tokens, parents = tree
    validate(tokens, parents, VOCAB)
    validate(tokens, parents, VOCAB, max_nodes=len(tokens))  # the limit itself is allowed


def test_invalid_tree_is_a_value_error():
    assert issubclass(InvalidTree, ValueError)


@pytest.mark.parametrize(
    "tokens, parents, max_nodes, field",
    [
        ([], [], None, "tree.tokens"),  # empty
        ([3, 4], [-1], None, "tree.parents"),  # fewer parents than tokens
        ([3], [-1, 0], None, "tree.parents"),  # more parents than tokens
        ([3, 4], [0, 0], None, "tree.parents[0]"),  # root points at itself
        ([3, 4], [1, 0], None, "tree.parents[0]"),  # root has a parent
        ([3, 4, 5], [-1, 0, 2], None, "tree.parents[2]"),  # self loop
        ([3, 4, 5], [-1, 2, 0], None, "tree.parents[1]"),  # forward reference (not topological)
        ([3, 4, 5], [-1, 2, 1], None, "tree.parents[1]"),  # cycle 1 -> 2 -> 1
        ([3, 4, 5], [-1, 0, 7], None, "tree.parents[2]"),  # out of range
        ([3, 4, 5], [-1, 0, -2], None, "tree.parents[2]"),  # negative
        ([3, 4, 5], [-1, 0, -1], None, "tree.parents[2]"),  # a second root
        ([3, VOCAB], [-1, 0], None, "tree.tokens[1]"),  # token == vocab size
        ([3, 4, -1], [-1, 0, 1], None, "tree.tokens[2]"),  # negative token
        ([VOCAB + 100], [-1], None, "tree.tokens[0]"),  # root outside the vocab
        ([1, 2, 3, 4], [-1, 0, 1, 2], 3, "tree.tokens"),  # over the node limit
    ],
)
def test_validate_rejects_with_the_field_named(tokens, parents, max_nodes, field):
    with pytest.raises(InvalidTree) as exc:
        validate(tokens, parents, VOCAB, max_nodes=max_nodes)
    msg = str(exc.value)
    assert msg.startswith(field), msg
    if max_nodes is not None:
        assert str(max_nodes) in msg and str(len(tokens)) in msg, msg


@given(trees(max_nodes=12), st.data())
@settings(max_examples=100, deadline=None)
def test_validate_rejects_any_single_corrupted_parent(tree, data):
    tokens, parents = tree
    if len(tokens) < 2:
        return
    i = data.draw(st.integers(1, len(tokens) - 1))
    bad = data.draw(st.one_of(st.integers(i, i + 5), st.integers(-5, -1)))
    corrupted = list(parents)
    corrupted[i] = bad
    with pytest.raises(InvalidTree, match=rf"^tree\.parents\[{i}\]"):
        validate(tokens, corrupted, VOCAB)


# -- depths, tree_inputs -------------------------------------------------------------------------------


@given(trees())
@settings(max_examples=100, deadline=None)
def test_depths_count_ancestors(tree):
    _, parents = tree
    assert depths(parents) == [len(ancestors(parents, i)) - 1 for i in range(len(parents))]


@given(trees(), st.integers(0, 7))
@settings(max_examples=150, deadline=None)
def test_tree_inputs_positions_and_mask_by_brute_force(tree, past):
    _, parents = tree
    n = len(parents)
    positions, mask = tree_inputs(parents, past)
    assert positions.dtype == torch.long
    assert positions.tolist() == [past + len(ancestors(parents, i)) - 1 for i in range(n)]
    if n == 1:
        assert mask is None
        return
    assert mask.dtype == torch.bool
    assert tuple(mask.shape) == (n, past + n)
    for i in range(n):
        anc = ancestors(parents, i)
        assert mask[i, :past].all(), f"node {i} must see every cached token"
        for j in range(n):
            assert bool(mask[i, past + j]) == (j in anc), (i, j, parents)


def test_tree_inputs_single_node():
    positions, mask = tree_inputs([-1], 11)
    assert positions.tolist() == [11]
    assert mask is None


def test_tree_inputs_chain_is_causal_and_siblings_are_hidden():
    positions, mask = tree_inputs([-1, 0, 1, 2], 2)
    assert positions.tolist() == [2, 3, 4, 5]
    expected = torch.ones((4, 6), dtype=torch.bool)
    expected[:, 2:] = torch.ones((4, 4), dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
    # two siblings at the same position never see each other
    positions, mask = tree_inputs([-1, 0, 0, 1, 2], 0)
    assert positions.tolist() == [0, 1, 1, 2, 2]
    assert mask.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, False, True, False, False],
        [True, True, False, True, False],
        [True, False, True, False, True],
    ]


# -- child_index ---------------------------------------------------------------------------------------


@given(trees(vocab=4))  # a tiny vocabulary makes duplicate siblings common
@settings(max_examples=100, deadline=None)
def test_child_index_maps_parent_and_token_to_the_first_such_child(tree):
    tokens, parents = tree
    idx = child_index(tokens, parents)
    expected = {}
    for i in range(1, len(tokens)):
        expected.setdefault((parents[i], tokens[i]), i)
    assert idx == expected
    for (p, t), c in idx.items():
        assert parents[c] == p and tokens[c] == t
        assert all(not (parents[j] == p and tokens[j] == t) for j in range(1, c))


def test_child_index_duplicate_siblings_first_wins():
    assert child_index([7, 3, 3, 5, 3], [-1, 0, 0, 1, 1]) == {(0, 3): 1, (1, 5): 3, (1, 3): 4}
