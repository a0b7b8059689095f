"""A greedy tree's output layer over the rows its acceptance reads (``verifier.engine._PathHead``).

The default model served from its GGUF blocks: the tree's first path through the layer at once, the
first path from where acceptance leaves it next, and the accepted path, the bonus, their top-k rows
and log-probabilities what the layer over every node gives; alone and in a batch of sessions.
"""

from __future__ import annotations

import pytest
import torch

from verifier import engine, native
from verifier.engine import VerifierSession, verify_batch

pytestmark = pytest.mark.skipif(not native.quant_supported(3), reason=f"native kernels not built: {native.why()}")

PROMPT = [1, 9690, 314, 253, 1535, 2377, 30, 2]  # any ids: the test reads the model's own greedy path


@pytest.fixture(scope="module")
def model():
    from verifier.model import load

    mp = pytest.MonkeyPatch()
    mp.delenv("RACER_KERNELS", raising=False)
    yield load("default", dtype="gguf").model
    mp.undo()


def _greedy(model, n: int) -> list[int]:
    s = VerifierSession(model, backend="llama")
    out = [s.prefill(PROMPT).next_token]
    for _ in range(n - 1):
        out.append(s.verify([out[-1]], [-1]).bonus)
    return out


def _session(model, counted: list[int] | None = None) -> VerifierSession:
    s = VerifierSession(model, backend="llama")
    s.logprobs = 2
    s.prefill(PROMPT)
    if counted is not None:
        layer = s.backend.logits
        s.backend.logits = lambda hidden: (counted.append(hidden.shape[0]), layer(hidden))[1]
    return s


def _trees(g: list[int]) -> dict[str, tuple[list[int], list[int]]]:
    """Trees from the session's next token g[0]: "first" holds the greedy continuation as its first
    path, side branches after it; "second" puts a wrong token first at the root and at depth 2, so
    acceptance leaves the first path twice."""
    wrong = [(t + 7) % 49152 for t in g]
    return {
        "first": (
            [g[0], g[1], g[2], g[3], wrong[1], wrong[2], wrong[3], g[4]],
            [-1, 0, 1, 2, 0, 1, 2, 3],
        ),
        "second": (
            [g[0], wrong[1], wrong[2], g[1], g[2], wrong[3], g[3], g[4]],
            [-1, 0, 1, 0, 3, 4, 4, 6],
        ),
    }


def _same(a, b, computed: set[int]) -> None:
    assert (a.accepted, a.bonus, a.logprobs) == (b.accepted, b.bonus, b.logprobs)
    assert all(a.topk[i] == b.topk[i] for i in computed)


def test_the_layer_runs_on_the_rows_acceptance_reads_and_gives_what_every_row_gives(model, monkeypatch):
    g = _greedy(model, 6)
    for name, (tokens, parents) in _trees(g).items():
        monkeypatch.setattr(engine, "_PATH_HEAD", False)
        full_rows: list[int] = []
        full = _session(model, full_rows).verify(tokens, parents)
        monkeypatch.setattr(engine, "_PATH_HEAD", True)
        rows: list[int] = []
        lazy = _session(model, rows).verify(tokens, parents)
        assert full_rows == [len(tokens)]
        if name == "first":  # the greedy path is the first path: one run of the layer, its 5 rows
            assert lazy.accepted == [0, 1, 2, 3, 7] and lazy.bonus == g[5]
            assert rows == [5]
            _same(lazy, full, {0, 1, 2, 3, 7})
        else:  # left at the root (to node 3) and at node 4 (to node 6): three runs
            assert lazy.accepted == [0, 3, 4, 6, 7] and lazy.bonus == g[5]
            assert rows == [3, 3, 2]  # [0, 1, 2], [3, 4, 5], [6, 7]
            _same(lazy, full, set(range(8)))
        # a node not computed takes the row of a computed node with its token, else its parent's
        assert len(lazy.topk) == len(tokens) and all(len(t) == len(full.topk[0]) for t in lazy.topk)


def test_a_batch_runs_the_layer_once_a_round_for_all_its_trees(model, monkeypatch):
    g = _greedy(model, 6)
    trees = _trees(g)
    monkeypatch.setattr(engine, "_PATH_HEAD", True)
    alone = {name: _session(model).verify(*tree) for name, tree in trees.items()}
    rows: list[int] = []
    sessions = [_session(model, rows), _session(model), _session(model)]
    chain = ([g[0], g[1]], [-1, 0])  # a chain: the layer over its rows as before, beside the trees
    got = verify_batch([(sessions[0], *trees["first"]), (sessions[1], *trees["second"]), (sessions[2], *chain)])
    assert rows == [5 + 3, 3, 2, 2]  # both trees' first rounds together, then "second"'s; the chain's
    _same(got[0], alone["first"], {0, 1, 2, 3, 7})
    _same(got[1], alone["second"], set(range(8)))
    assert got[2].accepted == [0, 1] and got[2].bonus == g[2]
    assert [s.length for s in sessions] == [len(PROMPT) + 5] * 2 + [len(PROMPT) + 2]


def test_sampling_and_grammar_masks_keep_the_layer_over_every_node(model, monkeypatch):
    from common.params import SamplingParams

    monkeypatch.setattr(engine, "_PATH_HEAD", True)
    tokens, parents = _trees(_greedy(model, 6))["second"]
    rows: list[int] = []
    s = _session(model, rows)
    s.set_sampling(SamplingParams(temperature=0.7, seed=3))
    s.verify(tokens, parents)
    s = _session(model, rows)
    s.masks = torch.ones((len(tokens), 49152), dtype=torch.bool)
    s.verify(tokens, parents)
    assert rows == [len(tokens), len(tokens)]
