"""A restored snapshot is the same drafter: same drafts now and after more tokens, same evictions."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.params import MODES
from drafter.session import DrafterConfig, DraftSession
from drafter.snapshot import SnapshotError, dumps, loads, snapshot_length

CFG = DrafterConfig(window=4, max_nodes=4 * 5 + 1 + 9, topk=3)


def _fill(s: DraftSession, rng: random.Random, n: int, vocab: int) -> None:
    for _ in range(n):
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        rows = [[rng.randrange(vocab) for _ in range(3)] for _ in toks]
        s.extend(toks, rows if rng.random() < 0.7 else None)


def _drafts(s: DraftSession, vocab: int) -> list:
    return [(t.tokens, t.parents) for m in MODES for root in range(vocab) for t in [s.draft(root, 12, m)]]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(0, 40), more=st.integers(1, 20))
def test_restored_session_drafts_and_evolves_like_the_original(seed, steps, more):
    rng = random.Random(seed)
    vocab = 6
    a = DraftSession(CFG, prior=np.arange(vocab * 3).reshape(vocab, 3) % vocab)
    _fill(a, rng, steps, vocab)
    b = loads(dumps(a), CFG, prior=a.table.prior)
    assert _drafts(b, vocab) == _drafts(a, vocab)
    # the same future on both: evictions, failure links, LRU order and prompt lookup must agree
    r1, r2 = random.Random(seed + 1), random.Random(seed + 1)
    _fill(a, r1, more, vocab)
    _fill(b, r2, more, vocab)
    assert _drafts(b, vocab) == _drafts(a, vocab)
    assert b.automaton.to_state() == a.automaton.to_state()


def test_full_capacity_session_round_trips():
    rng = random.Random(0)
    cfg = DrafterConfig()
    a = DraftSession(cfg)
    a.extend([rng.randrange(2000) for _ in range(3000)], [[rng.randrange(2000) for _ in range(8)] for _ in range(3000)])
    assert len(a.automaton.parent) == cfg.max_nodes
    data = dumps(a)
    assert snapshot_length(data) == 3000
    b = loads(data, cfg)
    assert b.automaton.to_state() == a.automaton.to_state()
    assert b.table.rows == a.table.rows and b.history == a.history


def test_mismatched_config_and_garbage_are_refused():
    a = DraftSession(CFG)
    a.extend([1, 2, 3])
    with pytest.raises(SnapshotError, match="window"):
        loads(dumps(a), DrafterConfig())
    with pytest.raises(SnapshotError):
        loads(b"not a snapshot", CFG)
    with pytest.raises(SnapshotError):
        loads(dumps(a)[:-40], CFG)
