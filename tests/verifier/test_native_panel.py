"""The panel kernel (verifier/native_panel.c) and the panel layout it reads (verifier/layouts.py).

Each output is one FMA chain over K in order, so a row's bits must not depend on how many rows share
the call, where the row sits, or how many threads run it; and the values must be a float32 product
of the weight's values, whatever panel, pass or thread an output falls in.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.support.models import make_tiny_llama
from verifier import layouts, native, plan_cache, tuning
from verifier.kernels import CANDIDATES

needs_panels = pytest.mark.skipif(native.panel_width() == 0, reason=f"native kernels not built here: {native.why()}")
HALF = (torch.bfloat16, torch.float16)


def _weight(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n, k), generator=g) / 8).to(dtype)


def _panel(x: torch.Tensor, w: torch.Tensor, b=None, threads: int | None = None) -> torch.Tensor:
    """The kernel over ``w`` (rows) stored as panels; float32 out (x widened from w's dtype)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return native.linear_panel(x.to(w.dtype), layouts.in_layout(w, "panel"), b).float()
    finally:
        torch.set_num_threads(before)


def _raw(x: torch.Tensor, p: torch.Tensor, b=None, threads: int = 2) -> torch.Tensor:
    """The library call itself: float32 x and output, no rounding to the weight's dtype."""
    lib = native.library()
    y = torch.empty((x.shape[0], p.shape[0]))
    kind = native.WEIGHT_TYPES[p.dtype]
    args = (x.data_ptr(), p.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), *x.shape[:1], p.shape[0])
    assert lib.racer_linear_panel(kind, *args, x.shape[1], threads) == 0
    return y


@needs_panels
@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
@pytest.mark.parametrize("n,k", [(16, 37), (48, 100), (192, 576), (96, 1536)])
def test_outputs_are_float32_products_of_the_weights_values(dtype, n, k):
    """Within float32 rounding of the exact product (a bound, per output, on K + 1 roundings)."""
    n = n // native.panel_width() * native.panel_width() or native.panel_width()
    w = _weight(n, k, dtype)
    b = torch.randn(n)
    p = layouts.in_layout(w, "panel")
    for m in (1, 5, 13, 64):
        x = torch.randn((m, k))
        y = _raw(x, p, b)
        exact = x.double() @ w.double().t() + b.double()
        bound = (k + 2) * 2.0**-24 * ((x.double().abs() @ w.double().abs().t()) + b.double().abs())
        assert ((y.double() - exact).abs() <= bound).all(), (dtype, n, k, m)


@needs_panels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n,k", [(32, 37), (192, 576), (576, 100)])
def test_a_rows_bits_are_the_same_alone_among_others_and_on_any_thread_count(dtype, n, k):
    n = max(n // native.panel_width(), 1) * native.panel_width()
    p = layouts.in_layout(_weight(n, k, dtype), "panel")
    b = torch.randn(n)
    x = torch.randn((70, k))
    full = _raw(x, p, b, threads=2)
    for m in (1, 2, 3, 5, 6, 7, 12, 13, 31, 64, 70):
        for threads in (1, 2, 3):
            assert torch.equal(_raw(x[:m].contiguous(), p, b, threads), full[:m]), (m, threads)
        last = x[m - 1 : m].contiguous()
        assert torch.equal(_raw(last, p, b)[0], full[m - 1]), m


@needs_panels
def test_the_identity_check_catches_a_small_change_in_one_row():
    """The negative control of the comparison above: it sees exactly the row that changed."""
    p = layouts.in_layout(_weight(64, 100, torch.bfloat16), "panel")
    x = torch.randn((20, 100), generator=torch.Generator().manual_seed(4))
    y = _raw(x, p)
    x[7, 3] *= 1 + 2**-8
    changed = (_raw(x, p) != y).any(dim=1).nonzero().flatten().tolist()
    assert changed == [7]


@needs_panels
def test_the_kernel_refuses_what_it_cannot_read():
    w = _weight(native.panel_width() + 1, 32, torch.bfloat16)
    with pytest.raises(TypeError, match="panels"):
        native.linear_panel(torch.randn((2, 32)).to(torch.bfloat16), w, None)
    with pytest.raises(TypeError):
        native.linear_panel(torch.randn((2, 32)).to(torch.bfloat16), w.t(), None)


@needs_panels
@pytest.mark.parametrize("dtype", HALF)
def test_the_layout_round_trips_and_an_embedding_reads_its_rows_from_panels(dtype):
    w = _weight(3 * native.panel_width(), 40, dtype)
    p = layouts.in_layout(w, "panel")
    assert layouts.stored_as(p) == "panel" and p.shape == w.shape and not torch.equal(p, w)
    assert torch.equal(layouts.in_layout(p, "row"), w)
    ids = torch.tensor([[0, 5, 17], [47, 16, 15]])
    assert torch.equal(layouts.embedding(p, ids), F.embedding(ids, w))
    # the kernel on panels computes what a row tile computes on rows, to within rounding
    x = torch.randn((4, 40)).to(dtype)
    assert torch.allclose(native.linear_panel(x, p, None).float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)


def _tiny(dtype):
    width = native.panel_width()
    m = make_tiny_llama(0, vocab_size=3 * width, hidden=2 * width).to(dtype)
    return m


@needs_panels
def test_a_forced_panel_plan_stores_every_weight_as_panels_and_hf_gets_rows_back(monkeypatch, tmp_path):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    model = _tiny(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        reference = model(ids).logits
    plan = tuning.kernel_plan(model, spec="panel")
    assert {sp.layout for sp in plan.shapes.values()} == {"panel"}
    assert all(layouts.stored_as(p) == "panel" for p in layouts.all_projections(model))
    with layouts.loaded_layout(model), torch.no_grad():
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert torch.equal(model(ids).logits, reference)
    assert all(layouts.stored_as(p) == "panel" for p in layouts.all_projections(model))


@needs_panels
def test_forced_specs_name_the_layout_the_panel_kernel_reads():
    weights = layouts.projection_weights(_tiny(torch.bfloat16))
    assert tuning.forced("panel", weights, invariant=True).shapes[next(iter(weights))].layout == "panel"
    for bad in ("panel@row", "native6x2@panel", "linear@panel"):
        with pytest.raises(ValueError):
            tuning.forced(bad, weights, invariant=True)
    with pytest.raises(ValueError):  # float32: no panels
        tuning.forced("panel", layouts.projection_weights(_tiny(torch.float32)), invariant=False)


@needs_panels
def test_an_invariant_tuning_times_the_panel_kernel_on_panels_only():
    w = _weight(4 * native.panel_width(), 64, torch.bfloat16)
    cands = {k: CANDIDATES[k] for k in ("linear", native.PANEL)}
    plan = tuning.tune_shape(w, buckets=(1, 4), invariant=True, reps=1, candidates=cands)
    timed = {(t.kernel, t.layout) for t in plan.ms}
    assert (native.PANEL, "panel") in timed and (native.PANEL, "row") not in timed
    assert ("linear", "panel") not in timed and ("linear", "row") in timed
    assert plan.layout == ("panel" if plan.kernel == native.PANEL else "row")


@needs_panels
def test_a_cached_panel_plan_is_read_back_and_refused_where_panels_cannot_be(monkeypatch, tmp_path):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    model = _tiny(torch.bfloat16)
    weights = layouts.projection_weights(model)
    shapes = tuning.forced("panel", weights, invariant=True).shapes
    path = tmp_path / "plan.json"
    plan_cache.write(path, {}, shapes, 0.0)
    assert {sp.layout for sp in plan_cache.read(path, weights, invariant=True).values()} == {"panel"}
    assert plan_cache.read(path, weights, invariant=False) is None  # float32 plans never keep panels
    data = json.loads(path.read_text())
    first = next(iter(data["shapes"]))
    data["shapes"][first]["kernel"] = "linear"  # a kernel that cannot read panels
    path.write_text(json.dumps(data))
    assert plan_cache.read(path, weights, invariant=True) is None
