"""The weights packed into one block in forward order: same values, same outputs, layouts kept in place."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import make_tiny_llama
from verifier import arena, layouts
from verifier.tuning import kernel_plan


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.setenv("RACER_KERNELS", "auto")
    monkeypatch.delenv("RACER_PACK", raising=False)
    return tmp_path


def _tied_tiny_llama():
    model = make_tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the default model's are
    return model


def test_every_parameter_lands_in_one_block_in_module_order_on_cache_lines(cache):
    model = _tied_tiny_llama()
    ids = torch.tensor([[3, 17, 5, 9, 40, 2]])
    with torch.inference_mode():
        before = model(ids).logits
    params = list(dict.fromkeys(model.parameters()))
    values = [p.detach().clone() for p in params]
    old = {p.data_ptr() for p in params}
    assert arena.pack(model) and arena.pack(model)  # once; a second call finds it packed
    ptrs = [p.data_ptr() for p in params]
    assert not old & set(ptrs)
    assert ptrs == sorted(ptrs) and all(ptr % 64 == 0 for ptr in ptrs)
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == len(params)  # one storage each, as loaded: tied-weight detection sees no sharing
    for p, ptr, nxt, v in zip(params, ptrs, ptrs[1:] + [None], values):
        assert torch.equal(p, v) and not p.is_inference()
        if nxt is not None:  # no overlap, and no more than a cache line of padding between neighbours
            assert ptr + p.numel() * p.element_size() <= nxt < ptr + p.numel() * p.element_size() + 64
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-6, rtol=1e-6)


def test_a_packed_weight_changes_layout_inside_its_own_slot(cache, monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setenv("RACER_KERNELS", "blas@col")
    kernel_plan(model)
    assert model._racer_packed
    for p in layouts.all_projections(model):
        slot = arena.slot(p)
        assert layouts.stored_as(p) == "col" and p.data_ptr() == slot.data_ptr()
    values = {id(p): p.detach().clone() for p in layouts.all_projections(model)}
    with layouts.loaded_layout(model):
        for p in layouts.all_projections(model):
            assert layouts.stored_as(p) == "row" and p.data_ptr() == arena.slot(p).data_ptr()
            assert torch.equal(p, values[id(p)])
    for p in layouts.all_projections(model):
        assert layouts.stored_as(p) == "col" and p.data_ptr() == arena.slot(p).data_ptr()
        assert torch.equal(p, values[id(p)])


def test_a_packed_model_in_any_layout_saves_and_loads_back(cache, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_tiny_llama()  # untied (transformers cannot save a tied weight stored transposed, packed or not)
    monkeypatch.setenv("RACER_KERNELS", "blas@col")
    kernel_plan(model)
    assert model._racer_packed and layouts.stored_as(model.model.layers[0].self_attn.q_proj.weight) == "col"
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_plan_is_measured_on_packed_weights_and_says_so_in_its_key(cache):
    import json

    model = make_tiny_llama()
    kernel_plan(model)
    assert model._racer_packed and all(arena.slot(p) is not None for p in model.parameters())
    (path,) = (cache / "kernels").glob("*.json")
    assert json.loads(path.read_text())["key"]["packed"] is True


def test_packing_off_leaves_the_weights_where_they_were_loaded(cache, monkeypatch):
    monkeypatch.setenv("RACER_PACK", "off")
    monkeypatch.setenv("RACER_KERNELS", "linear")  # rows: no layout moves a weight either
    model = make_tiny_llama()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert not arena.pack(model)
    kernel_plan(model)
    assert not getattr(model, "_racer_packed", False)
    assert all(arena.slot(p) is None for p in model.parameters())
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_a_model_built_in_inference_mode_keeps_its_storage(cache):
    with torch.inference_mode():
        model = make_tiny_llama()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert not arena.pack(model)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
