"""``racer bench``'s HF baselines run Hugging Face as its users do: on the weights as loaded, even when
the llama backend stored some transposed, which it gets back afterwards."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from racer.bench.modes import run_engine, run_hf
from racer.inprocess import InProcessStack
from tests.support.engine import hf_greedy
from tests.support.families import echo_prompt
from tests.support.models import make_tiny_llama
from verifier import layouts
from verifier.model import LoadedModel


def test_hf_baseline_runs_on_the_loaded_layout_and_the_engine_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.setenv("RACER_KERNELS", "blas@col")
    model = make_tiny_llama()
    prompt = echo_prompt(model)
    expected = hf_greedy(model, prompt, 16, eos=(2,))  # before any plan: every weight as loaded
    engine = InProcessStack(
        LoadedModel(model, SimpleNamespace(pad_token_id=0, eos_token_id=2), Path(tmp_path)), prior=None
    )
    engine.tune_kernels()
    assert all(layouts.stored_as(p) == "col" for p in layouts.all_projections(model))

    seen = []
    generate = model.generate

    def spy(*args, **kw):  # what HF's forward runs on, while the baseline is timed
        seen.append({layouts.stored_as(p) for p in layouts.all_projections(model)})
        return generate(*args, **kw)

    monkeypatch.setattr(model, "generate", spy)
    out, secs = run_hf(engine, prompt, 16)
    assert seen == [{"row"}] and out == expected and secs > 0
    assert all(layouts.stored_as(p) == "col" for p in layouts.all_projections(model))
    engine_out, *_ = run_engine(engine, prompt, "racer", 8, 16)
    assert engine_out == expected
    with torch.inference_mode():
        assert not any(p.is_inference() for p in model.parameters())
