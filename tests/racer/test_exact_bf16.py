"""Reduced-precision exactness contract (bfloat16, and float16 alike): speculation never changes what
the engine itself produces.

Every drafting mode and budget, alone and with sessions batched together, emits token for token
what ``off`` (one token per forward, no drafts) emits in the same dtype.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.loop import generate
from common.params import MODES, GenerationParams
from drafter.draft_session import DraftSession
from tests.support.models import make_tiny_llama
from tests.verifier.test_batch_invariance import make_wide_llama
from verifier.engine import VerifierSession

N = 40


@pytest.fixture(scope="module", params=[("tiny", "bfloat16"), ("wide", "bfloat16"), ("wide", "float16")])
def bf16_llama(request, tmp_path_factory):
    size, dtype = request.param
    mp = pytest.MonkeyPatch()
    mp.setenv("RACER_KERNELS", "linear:4")  # 4-row chunks: a 1-row step pads, trees span chunks
    mp.setenv("RACER_CACHE", str(tmp_path_factory.mktemp("cache")))
    dtype = getattr(torch, dtype)
    yield make_tiny_llama().to(dtype) if size == "tiny" else make_wide_llama(dtype=dtype)
    mp.undo()


def _prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 96) for _ in range(n)]


def _run(model, prompt, mode, budget):
    v = VerifierSession(model, backend="llama")
    return [
        t
        for c in generate(DraftSession(), v, prompt, GenerationParams(max_new_tokens=N, mode=mode, budget=budget))
        for t in c
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_mode_and_budget_equals_off_in_bf16(bf16_llama, seed):
    prompt = _prompt(seed)
    off = _run(bf16_llama, prompt, "off", 1)
    assert len(off) == N
    for mode in MODES:
        for budget in (4, 64):
            assert _run(bf16_llama, prompt, mode, budget) == off, f"{mode} C={budget}"


def test_batched_bf16_sessions_equal_off_alone(bf16_llama):
    from tests.verifier.test_batch import _lockstep
    from tests.verifier.test_batch import _prompt as batch_prompt

    specs = [(24, "racer", 16, None), (11, "logits", 8, None), (30, "retrieval", 64, None), (7, "pld", 4, None)]
    off = [_run(bf16_llama, batch_prompt(i, n), "off", 1)[:30] for i, (n, *_rest) in enumerate(specs)]
    assert _lockstep(bf16_llama, specs) == off
