"""verifier/engine.py: VerifierSession prefill, input validation, set_sampling."""

from __future__ import annotations

import random

import pytest
import torch

from common.params import SamplingParams
from verifier.engine import VerifierSession, make_backend
from verifier.hf import HFBackend
from verifier.llama import LlamaBackend
from verifier.tree import InvalidTree


def session(model, backend):
    if backend == "llama-small":
        s = VerifierSession(model, backend="llama")
        s.backend = LlamaBackend(model, capacity=16)
        return s
    return VerifierSession(model, backend=backend)


@pytest.mark.parametrize("backend", ["llama", "hf", "llama-small"])
def test_prefill_topk_rows_and_next_token_over_the_chunk_boundary(tiny_llama, backend):
    model = tiny_llama
    rng = random.Random(0)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(300)]  # > 256-row logits chunks
    s = session(model, backend)
    s.topk = 4
    res = s.prefill(prompt)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0]
    assert s.length == 300
    assert len(res.topk) == 300
    assert res.topk == torch.topk(logits, 4, dim=-1).indices.tolist()
    assert res.next_token == int(logits[-1].argmax())


@pytest.mark.parametrize("backend", ["llama", "hf"])
def test_invalid_inputs_leave_the_session_usable(tiny_llama, backend):
    model = tiny_llama
    v = model.config.vocab_size
    s = VerifierSession(model, backend=backend)
    with pytest.raises(ValueError, match="prefill"):
        s.prefill([])
    with pytest.raises(InvalidTree, match=r"tree\.tokens\[1\]"):
        s.prefill([3, v])
    assert s.length == 0
    root = s.prefill([1, 5, 9, 13]).next_token
    for tokens, parents in (([root, v + 1], [-1, 0]), ([root, 4], [-1, 1]), ([], []), ([root, 4], [0, 0])):
        with pytest.raises(InvalidTree):
            s.verify(tokens, parents)
        assert s.length == 4
    res = s.verify([root], [-1])  # the failed calls left no trace: this continues the prompt
    assert s.length == 5
    with torch.inference_mode():
        want = int(model(torch.tensor([[1, 5, 9, 13, root]])).logits[0, -1].argmax())
    assert res.bonus == want


def test_set_sampling_switches_between_greedy_and_sampling(tiny_llama):
    model = tiny_llama
    prompt = [1, 5, 9, 13, 5, 9]
    with torch.inference_mode():
        greedy_next = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    s = VerifierSession(model, sampling=SamplingParams(temperature=50.0, seed=0))
    picks = set()
    for _ in range(8):  # nearly uniform: sampling shows
        s.truncate(0)
        picks.add(s.prefill(prompt).next_token)
    assert len(picks) > 1
    s.set_sampling(SamplingParams())
    s.truncate(0)
    assert s.prefill(prompt).next_token == greedy_next
    # the same seed after set_sampling restarts the same stream of draws
    draws = []
    for _ in range(2):
        s.set_sampling(SamplingParams(temperature=1.0, seed=7))
        s.truncate(0)
        draws.append([s.prefill(prompt).next_token, s.prefill([3]).next_token])
    assert draws[0] == draws[1]


def test_make_backend_rejects_unknown_kinds(tiny_llama):
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend(tiny_llama, "nope")


@pytest.mark.parametrize(("old", "new", "cls"), [("fast", "llama", LlamaBackend), ("generic", "hf", HFBackend)])
def test_the_old_backend_names_still_work_and_warn(tiny_llama, old, new, cls):
    with pytest.warns(DeprecationWarning, match=f"backend '{old}' is now called '{new}'"):
        backend = make_backend(tiny_llama, old)
    assert type(backend) is cls and type(make_backend(tiny_llama, new)) is cls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["llama", "hf"])
def test_model_on_cuda_gives_the_cpu_results(backend):
    from tests.support.models import make_tiny_llama

    cpu = make_tiny_llama()
    gpu = make_tiny_llama().cuda()
    prompt = [1, 5, 9, 13, 5, 9]
    a, b = VerifierSession(cpu, backend=backend), VerifierSession(gpu, backend=backend)
    ra, rb = a.prefill(prompt), b.prefill(prompt)
    assert ra.next_token == rb.next_token
    tree = ([ra.next_token, 5, 9, 13], [-1, 0, 0, 1])
    va, vb = a.verify(*tree), b.verify(*tree)
    assert (va.accepted, va.bonus) == (vb.accepted, vb.bonus)
