"""Property tests for drafter.copy_logits.CopyLogitTable against a plain dict model (+ optional prior)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.copy_logits import CopyLogitTable

row_st = st.lists(st.integers(0, 50), max_size=12)
op_st = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 8), row_st),
    st.tuples(
        st.just("put_many"),
        st.lists(st.integers(0, 8), max_size=6),
        st.lists(row_st, max_size=6),
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10), st.lists(op_st, max_size=30), st.lists(st.integers(-2, 12), max_size=10))
def test_table_matches_dict_model(k, ops, probes):
    table = CopyLogitTable(k)
    model: dict[int, tuple[int, ...]] = {}
    for op in ops:
        if op[0] == "put":
            _, tok, row = op
            table.put(tok, row)
            model[tok] = tuple(row)[:k]
        else:
            _, toks, rows = op
            # documented contract: pairs in order, later positions win (zip semantics on length mismatch)
            table.put_many(toks, rows)
            for tok, row in zip(toks, rows):
                model[tok] = tuple(row)[:k]
        assert len(table) == len(model)
        for tok, row in model.items():
            got = table.get(tok)
            assert got == row, f"token {tok}: got {got}, last written {row}"
            assert isinstance(got, tuple) and len(got) <= k
    for p in probes:
        if p not in model:
            assert table.get(p) == ()


@given(st.integers(1, 10), st.integers(0, 8), st.lists(st.integers(0, 50), max_size=12))
def test_rows_are_snapshots_not_aliases(k, tok, row):
    """A stored row must not change when the caller mutates the list it passed in."""
    table = CopyLogitTable(k)
    src = list(row)
    table.put(tok, src)
    src.append(99)
    src[:] = [-1] * len(src)
    assert table.get(tok) == tuple(row[:k])
    src2 = list(row)
    table.put_many([tok], [src2])
    src2[:] = [-1] * len(src2)
    assert table.get(tok) == tuple(row[:k])


@given(st.integers(-10, 0))
def test_k_must_be_positive(k):
    with pytest.raises(ValueError):
        CopyLogitTable(k)


def test_put_many_later_positions_win():
    table = CopyLogitTable(2)
    table.put_many([5, 6, 5], [[1, 2, 3], [4], [7, 8, 9]])
    assert table.get(5) == (7, 8)
    assert table.get(6) == (4,)
    assert table.get(0) == ()


prior_st = st.one_of(
    st.none(),
    st.integers(0, 9)
    .flatmap(
        lambda vocab: st.lists(
            st.lists(st.integers(0, 9), unique=True, min_size=10, max_size=10), min_size=vocab, max_size=vocab
        )
    )
    .flatmap(lambda rows: st.sampled_from([rows, np.array(rows, dtype=np.uint16).reshape(len(rows), 10)])),
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10), prior_st, st.lists(op_st, max_size=20), st.lists(st.integers(-3, 12), max_size=12))
def test_table_with_prior_matches_model(k, prior, ops, probes):
    """Rows written by the session win; unseen tokens fall back to the prior's row (first k, as plain
    ints); tokens outside the prior (or with no prior) give (). The prior is never written to."""
    snapshot = None if prior is None else [list(map(int, r)) for r in prior]
    table = CopyLogitTable(k, prior)
    model: dict[int, tuple[int, ...]] = {}
    for op in ops:
        if op[0] == "put":
            table.put(op[1], op[2])
            model[op[1]] = tuple(op[2])[:k]
        else:
            table.put_many(op[1], op[2])
            for tok, row in zip(op[1], op[2]):
                model[tok] = tuple(row)[:k]
    n_prior = 0 if prior is None else len(prior)
    for t in list(model) + list(probes):
        got = table.get(t)
        if t in model:
            want = model[t]
        elif 0 <= t < n_prior:
            want = tuple(snapshot[t][:k])
        else:
            want = ()
        assert got == want, f"token {t}: got {got}, want {want}"
        assert isinstance(got, tuple) and all(type(x) is int for x in got)
    assert len(table) == len(model)  # the prior is not counted as the session's own rows
    if prior is not None:
        assert [list(map(int, r)) for r in prior] == snapshot
