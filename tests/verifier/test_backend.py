"""verifier/backend.py: both backends are a ``Backend``, and ``kept_rows`` is the commit both run."""

from __future__ import annotations

import inspect

import pytest

from verifier.backend import Backend, kept_rows
from verifier.hf import HFBackend
from verifier.llama import LlamaBackend

METHODS = [name for name, v in vars(Backend).items() if inspect.isfunction(v) and not name.startswith("_")]


@pytest.mark.parametrize("cls", [LlamaBackend, HFBackend])
def test_each_backend_has_the_protocols_members_with_its_signatures(tiny_llama, cls):
    backend = cls(tiny_llama)
    assert isinstance(backend, Backend)
    assert set(METHODS) == {"forward", "logits", "commit", "truncate", "pad_rows", "resize"}
    for name in METHODS:
        want = list(inspect.signature(getattr(Backend, name)).parameters.values())
        got = list(inspect.signature(getattr(cls, name)).parameters.values())
        assert [p.name for p in got[: len(want)]] == [p.name for p in want], name
        assert all(p.default is not inspect.Parameter.empty for p in got[len(want) :]), name  # extras optional
    for attr in Backend.__annotations__:
        assert hasattr(backend, attr), attr
    assert (backend.invariant, backend.chain_only, backend.reserved_rows) == (False, False, None)


def test_an_object_without_the_members_is_not_a_backend(tiny_llama):
    class Partial:
        def forward(self, tokens, positions, mask): ...

    assert not isinstance(Partial(), Backend)


@pytest.mark.parametrize(
    ("keep", "n_new", "want"),
    [
        (None, 5, (5, False)),
        ([0, 1, 2], 5, (3, False)),
        ([], 4, (0, False)),
        ([0, 2, 3], 5, (3, True)),
        ([1], 2, (1, True)),
    ],
)
def test_kept_rows(keep, n_new, want):
    assert kept_rows(keep, n_new) == want
