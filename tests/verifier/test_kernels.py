"""Kernel selection (verifier/kernels.py, tuning.py, plan_cache.py, layouts.py): measured choices
agree with F.linear, are cached per key, and the invariant plan's chunks really are position
invariant (checked, not assumed)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from racer.bench.tiny import FAMILIES
from tests.support.models import make_tiny_llama
from verifier import kernels, layouts, native, plan_cache, tuning
from verifier.kernels import BUCKETS, CANDIDATES, Timing, chunked
from verifier.model import auto_dtype, resolve_dtype, serving_backend
from verifier.tuning import kernel_plan, position_invariant, tune_shape

ROWS = sorted({*BUCKETS, 3, 5, 13, 33, 70, 130})  # buckets, rows between them, rows beyond the largest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.setenv("RACER_KERNELS", "auto")
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tuned_choice_agrees_with_linear_for_every_shape_and_row_count(cache, dtype):
    model = make_tiny_llama().to(dtype)
    plan = kernel_plan(model)
    assert plan.source == "tuned" and plan.invariant == (dtype != torch.float32)
    weights = layouts.projection_weights(model)
    assert set(plan.shapes) == set(weights) == {(64, 64), (32, 64), (128, 64), (64, 128), (96, 64)}
    gen = torch.Generator().manual_seed(0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for shape, w in weights.items():
        rows = layouts.in_layout(w, "row")  # the values, whichever layout the plan stored them in
        for n in ROWS:
            x = torch.randn((n, w.shape[1]), generator=gen).to(dtype)
            y = plan.mm(x, w, None)
            assert y.shape == (n, w.shape[0]) and y.is_contiguous()
            torch.testing.assert_close(y.float(), F.linear(x, rows).float(), **tol, msg=f"{shape} x {n} rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_candidate_agrees_with_linear(dtype):
    w = torch.randn(96, 64).to(dtype)
    stored = {"row": w, "col": w.t().contiguous().t()}  # the same weight stored as is and transposed
    if layouts.panelable(w):
        stored["panel"] = layouts.in_layout(w, "panel")
    assert [layouts.stored_as(v) for v in stored.values()] == list(stored)
    usable = [name for name in CANDIDATES if kernels.usable(name, w.device, dtype)]
    assert ("blas" in usable) == (dtype == torch.float32)  # numpy has no bfloat16
    assert (native.PANEL in usable) == (dtype != torch.float32 and native.panel_width() > 0)
    for n in (1, 2, 7, 64):
        x = torch.randn(n, 64).to(dtype)
        for layout, wl in stored.items():
            for name in usable:
                if layout == "col" and layout not in kernels.reads(name):
                    with pytest.raises(TypeError):  # the tuner skips it on a transposed weight
                        CANDIDATES[name](x, wl, None)
                    continue
                if layout not in kernels.reads(name):  # contiguous values in another order: never called
                    continue
                try:
                    y = CANDIDATES[name](x, wl, None)
                except RuntimeError:  # a candidate without a kernel for this dtype here is never chosen
                    continue
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                msg = f"{name} x {n} ({layout})"
                assert y.is_contiguous(), msg
                torch.testing.assert_close(y.float(), F.linear(x, w).float(), atol=tol, rtol=tol, msg=msg)


def test_a_weight_stored_transposed_keeps_its_values_and_the_model_its_output(cache, monkeypatch):
    model = make_tiny_llama()
    ids = torch.tensor([[3, 17, 5, 9, 40, 2]])
    with torch.inference_mode():
        before = model(ids).logits
    values = {id(p): p.detach().clone() for p in layouts.all_projections(model)}
    monkeypatch.setenv("RACER_KERNELS", "blas@col")
    plan = kernel_plan(model)
    assert all(sp.layout == "col" for sp in plan.shapes.values()) and "stored transposed" in plan.describe()
    for p in layouts.all_projections(model):
        assert layouts.stored_as(p) == "col" and torch.equal(p, values[id(p)])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("RACER_KERNELS", "linear")  # another plan stores them as rows again
    kernel_plan(model)
    assert all(layouts.stored_as(p) == "row" and torch.equal(p, values[id(p)]) for p in layouts.all_projections(model))


def test_tuning_times_transposed_weights_in_float32_and_panels_in_reduced_precision(cache):
    w = torch.randn(96, 64)
    plan = tune_shape(w, buckets=(1, 4), reps=1)
    assert plan.layout in ("row", "col") and any(t.layout == "col" for t in plan.ms)
    assert not any(t.layout == "panel" for t in plan.ms)
    assert any(t.kernel == "blas" for t in plan.ms) and {t.rows for t in plan.ms} == {1, 4}
    plan = tune_shape(w.to(torch.bfloat16), buckets=(1, 4), reps=1, invariant=True)
    assert not any(t.layout == "col" or t.kernel.startswith("blas") for t in plan.ms)
    panels = layouts.panelable(w.to(torch.bfloat16))
    assert {t.layout for t in plan.ms} == ({"row", "panel"} if panels else {"row"})
    assert plan.layout in kernels.reads(plan.kernel)


def test_choice_is_cached_per_model_dtype_and_threads(cache):
    model = make_tiny_llama()
    first = kernel_plan(model)
    files = list((cache / "kernels").glob("*.json"))
    assert first.source == "tuned" and len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["key"]["dtype"] == "float32" and record["key"]["threads"] == torch.get_num_threads()
    assert record["key"]["machine"]["torch"] == torch.__version__
    again = kernel_plan(make_tiny_llama(seed=1))  # same shapes, another object: read back, not tuned
    assert again.source == "cache" and again.describe().split(":", 1)[1] == first.describe().split(":", 1)[1]
    assert all(again.shapes[s].ms == sp.ms and sp.ms for s, sp in first.shapes.items())  # the records read back
    kernel_plan(make_tiny_llama().to(torch.bfloat16))
    kernel_plan(make_tiny_llama(vocab_size=80))
    assert len(list((cache / "kernels").glob("*.json"))) == 3  # dtype and model are part of the key
    with torch.inference_mode():
        torch.set_num_threads(2)
        try:
            assert kernel_plan(make_tiny_llama()).source == "tuned"
        finally:
            torch.set_num_threads(1)
    assert len(list((cache / "kernels").glob("*.json"))) == 4


def test_forced_kernel_skips_tuning(cache, monkeypatch):
    monkeypatch.setenv("RACER_KERNELS", "linear:4")
    plan = kernel_plan(make_tiny_llama().to(torch.bfloat16))
    assert plan.source == "forced" and all(p.kernel == "linear" and p.rows == 4 for p in plan.shapes.values())
    assert not (cache / "kernels").exists()
    for spec in ("nope", "linear@diagonal"):
        monkeypatch.setenv("RACER_KERNELS", spec)
        with pytest.raises(ValueError):
            kernel_plan(make_tiny_llama())
    for spec in ("blas", "linear@col"):  # numpy has no bfloat16; reduced precision keeps its rows
        monkeypatch.setenv("RACER_KERNELS", spec)
        with pytest.raises(ValueError):
            kernel_plan(make_tiny_llama().to(torch.bfloat16))


def test_chunked_rows_are_bit_identical_alone_and_in_any_call():
    w = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(70, 64).to(torch.bfloat16)
    for rows in (1, 4, 16):
        full = chunked(kernels._linear, x, w, None, rows)
        for r in (0, 5, 31, 69):
            assert torch.equal(chunked(kernels._linear, x[r : r + 1], w, None, rows)[0], full[r])
            assert torch.equal(chunked(kernels._linear, x[r:], w, None, rows)[0], full[r])


def test_position_check_rejects_a_kernel_whose_rows_depend_on_their_neighbours():
    def leaky(x, w, b):  # each row picks up a trace of the row before it
        y = F.linear(x, w, b)
        return y + 1e-3 * torch.roll(y, 1, 0)

    w = torch.randn(32, 64)
    assert position_invariant(kernels._linear, w, 4)
    assert not position_invariant(leaky, w, 4)
    plan = tune_shape(w.to(torch.bfloat16), buckets=(1, 2, 4), invariant=True, reps=1, candidates={"linear": leaky})
    assert plan.rows == 1  # every multi-row chunk failed the check; one-row chunks cannot


# -- --dtype auto: one test per choice, the CPU's features faked (never the machine's own) ------------


@pytest.fixture
def cpu(monkeypatch):
    """``cpu(native_bf16, block_kernel)``: what ``auto_dtype`` learns of the CPU, faked: torch's AMX and
    AVX512-BF16 probes, and whether the GGUF block kernel is built (``native.quant_supported``)."""

    def fake(native_bf16: bool, block_kernel: bool = False) -> None:
        for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
            monkeypatch.setattr(torch.cpu, probe, lambda: native_bf16, raising=False)
        monkeypatch.setattr(native, "quant_supported", lambda kind: block_kernel)

    return fake


def _model_dir(path, family: str) -> str:
    """A directory holding ``family``'s config.json only: ``auto`` decides from the config, no weights."""
    from racer.bench.tiny import make

    make(family).config.save_pretrained(path)
    return str(path)


@pytest.fixture
def llama_dir(tmp_path):
    return _model_dir(tmp_path / "llama", "llama")


@pytest.fixture
def hf_dir(tmp_path):
    """A sliding-window model: the llama backend does not implement it, the hf one verifies it."""
    return _model_dir(tmp_path / "mistral-swa", "mistral-swa")


def test_auto_on_cuda_is_bfloat16(cpu, llama_dir):
    cpu(native_bf16=False, block_kernel=True)  # the CPU's features do not matter on CUDA
    assert auto_dtype("cuda", llama_dir) == "bfloat16"
    assert auto_dtype("cuda") == "bfloat16"  # the bundled model too


def test_auto_serves_the_bundled_model_from_its_gguf_blocks_where_the_block_kernel_is_built(cpu):
    cpu(native_bf16=False, block_kernel=True)
    assert auto_dtype("cpu") == "gguf"
    assert resolve_dtype("auto", "cpu", "default") == "gguf"
    cpu(native_bf16=True, block_kernel=False)  # no block kernel: as any llama-family model
    assert auto_dtype("cpu") == "bfloat16"


def test_auto_is_bfloat16_for_a_llama_family_model_on_a_cpu_that_multiplies_it_natively(cpu, llama_dir):
    cpu(native_bf16=True, block_kernel=True)  # the block kernel serves the bundled model only
    assert auto_dtype("cpu", llama_dir) == "bfloat16"
    assert resolve_dtype("auto", "cpu", llama_dir, "llama") == "bfloat16"


def test_auto_is_float32_for_a_llama_family_model_on_a_cpu_without_native_bfloat16(cpu, llama_dir):
    cpu(native_bf16=False, block_kernel=True)
    assert auto_dtype("cpu", llama_dir) == "float32"
    cpu(native_bf16=False, block_kernel=False)
    assert auto_dtype("cpu") == "float32"  # the bundled model without the block kernel


def test_auto_is_float32_for_a_model_on_the_hf_backend_even_where_the_cpu_multiplies_bfloat16(cpu, hf_dir, llama_dir):
    """The hf backend verifies in float32 only (``backend_for`` refuses bfloat16): ``auto`` never
    picks what the backend that will verify the model refuses."""
    cpu(native_bf16=True, block_kernel=True)
    assert auto_dtype("cpu", hf_dir) == "float32"
    assert auto_dtype("cuda", hf_dir) == "float32"
    assert resolve_dtype("auto", "cpu", hf_dir, "auto") == "float32"
    # --backend hf for a model the llama backend implements, and for the bundled one (old name too)
    assert auto_dtype("cpu", llama_dir, "hf") == "float32"
    assert auto_dtype("cpu", "default", "hf") == "float32"
    assert auto_dtype("cpu", "default", "generic") == "float32"


def test_a_dtype_given_stays_as_it_is(cpu, hf_dir):
    cpu(native_bf16=True, block_kernel=True)
    assert resolve_dtype("bfloat16", "cpu", "default") == "bfloat16"
    assert resolve_dtype("float32", "cpu", "default") == "float32"
    assert resolve_dtype("bfloat16", "cpu", hf_dir) == "bfloat16"  # and the verifier refuses it at start-up
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        resolve_dtype("half")


def test_a_directory_without_config_json_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        auto_dtype("cpu", str(tmp_path))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_backend_auto_plans_for_is_the_one_make_backend_builds(family, tmp_path):
    """``serving_backend`` decides from config.json alone (modules on the meta device) what
    ``backend_for`` decides on the loaded model, for every family the tests build."""
    from racer.bench.tiny import make
    from verifier.engine import backend_for

    model = make(family)
    model.config.save_pretrained(tmp_path)
    assert serving_backend(str(tmp_path)) == backend_for(model) == ("llama" if FAMILIES[family][2] == "llama" else "hf")
    assert serving_backend(str(tmp_path), "hf") == "hf"


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v projections with biases
@pytest.mark.parametrize(
    "spec",
    [
        s
        for s in ("blas@col", "blas_wxt@col", "blas", "onednn@col", "linear@col", *native.VARIANTS)
        if s.split("@")[0] in CANDIDATES
    ],
)
def test_lean_forward_on_each_kernel_and_layout_equals_hf(cache, monkeypatch, family, spec):
    from tests.support.engine import hf_greedy
    from tests.support.families import echo_prompt, make
    from verifier.engine import VerifierSession

    model = make(family)
    if spec in native.VARIANTS and not kernels.usable(spec, torch.device("cpu")):
        # a tile shape meant for another vector width: refused by name, never run
        with pytest.raises(ValueError, match="not available"):
            kernel_plan(model, spec=spec)
        return
    if family == "llama":  # tied output layer and embedding: one Parameter, converted once
        model.lm_head.weight = model.model.embed_tokens.weight
    prompt = echo_prompt(model)
    with torch.inference_mode():
        ref_logits = model(torch.tensor([prompt])).logits[0]
    ref = hf_greedy(model, prompt, 24)
    monkeypatch.setenv("RACER_KERNELS", spec)
    session = VerifierSession(model)
    layout = "col" if spec.endswith("@col") else "row"
    assert all(layouts.stored_as(p) == layout for p in layouts.all_projections(model))
    assert layouts.stored_as(model.model.embed_tokens.weight) == (layout if family == "llama" else "row")
    session.prefill(prompt[:-1])
    with torch.inference_mode():
        hidden = session.backend.forward(torch.tensor(prompt[-1:]), torch.tensor([len(prompt) - 1]), None)
        torch.testing.assert_close(session.backend.logits(hidden)[0], ref_logits[-1], atol=1e-4, rtol=1e-4)
    from tests.support.engine import run_racer

    for budget in (1, 8):
        assert run_racer(model, list(prompt), "auto", max_new_tokens=24, budget=budget)[0] == ref


def test_blas_candidates_add_the_bias():
    w, b = torch.randn(48, 64), torch.randn(48)
    x = torch.randn(5, 64)
    for name in ("blas", "blas_wxt"):
        for wl in (w, w.t().contiguous().t()):
            torch.testing.assert_close(CANDIDATES[name](x, wl, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_loaded_layout_gives_hf_its_rows_for_the_block_and_the_plan_its_layout_back(cache, monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setenv("RACER_KERNELS", "blas@col")
    kernel_plan(model)
    values = {id(p): p.detach().clone() for p in layouts.all_projections(model)}
    with layouts.loaded_layout(model) as m:
        assert m is model and all(layouts.stored_as(p) == "row" for p in model.parameters())
    for p in layouts.all_projections(model):
        assert layouts.stored_as(p) == "col" and torch.equal(p, values[id(p)]) and not p.is_inference()


def test_a_later_measured_plan_keeps_the_layout_a_forward_may_be_reading(cache, monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setenv("RACER_KERNELS", "blas@col")
    kernel_plan(model)
    monkeypatch.setenv("RACER_KERNELS", "auto")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # another thread count: a new plan, measured
    try:
        plan = kernel_plan(model)
    finally:
        torch.set_num_threads(threads)
    assert plan.source == "tuned" and all(sp.layout == "col" for sp in plan.shapes.values())
    assert all(layouts.stored_as(p) == "col" for p in layouts.all_projections(model))
    assert not (cache / "kernels").exists()  # a plan constrained so is not what the machine measures best


def test_a_cached_plan_unusable_here_is_measured_again(cache):
    model = make_tiny_llama().to(torch.bfloat16)
    assert kernel_plan(model).source == "tuned"
    (path,) = (cache / "kernels").glob("*.json")
    record = json.loads(path.read_text())
    # unchunked: only for a kernel invariant by construction (native), never for F.linear
    # ... and medians keyed by strings, as an older version wrote them
    bad_fields = ({"layout": "col"}, {"kernel": "blas"}, {"kernel": "linear", "rows": 0}, {"by_bucket": "nope"})
    for bad in (*bad_fields, {"ms": {"linear@1": 0.5, "forward:per-shape@1": 0.7}}):
        broken = json.loads(json.dumps(record))
        for shape in broken["shapes"].values():
            shape.update(bad)
        path.write_text(json.dumps(broken))
        plan = kernel_plan(make_tiny_llama().to(torch.bfloat16))
        assert plan.source == "tuned", bad
        assert all(
            sp.layout in kernels.reads(sp.kernel)
            and sp.layout != "col"
            and sp.kernel != "blas"
            and (sp.rows >= 1 or kernels.row_invariant(sp.kernel))
            for sp in plan.shapes.values()
        )


def test_numpy_blas_runs_on_the_calling_thread_and_torch_keeps_its_threads(cache):
    from threadpoolctl import threadpool_info

    threads = torch.get_num_threads()
    kernel_plan(make_tiny_llama())
    numpy_blas = [i for i in threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"]]
    assert numpy_blas and all(i["num_threads"] == 1 for i in numpy_blas)
    assert torch.get_num_threads() == threads


def _slow(x, w, b):
    """A kernel with the right result at many times the cost."""
    for _ in range(40):
        y = F.linear(x, w, b)
    return y


def test_the_whole_forward_check_replaces_a_choice_that_loses_there(cache, monkeypatch):
    monkeypatch.setitem(CANDIDATES, "slow", _slow)
    model = make_tiny_llama()
    shapes = {s: kernels.ShapePlan(by_bucket={1: "slow", 4: "slow"}) for s in layouts.projection_weights(model)}
    kept = tuning.compose(model, shapes, buckets=(1, 4), reps=1)
    assert kept == {1: "linear", 4: "linear"}
    assert all(sp.by_bucket == {1: "linear", 4: "linear"} for sp in shapes.values())
    assert all(Timing("linear", sp.layout, 4, forward=True) in sp.ms for sp in shapes.values())
    # A winning per-shape choice stays: F.linear used everywhere is the slow one this time.
    monkeypatch.setattr(kernels, "_linear", _slow)
    monkeypatch.setitem(CANDIDATES, "linear", _slow)
    shapes = {s: kernels.ShapePlan(by_bucket={1: "wxt", 4: "wxt"}) for s in layouts.projection_weights(model)}
    assert tuning.compose(model, shapes, buckets=(1, 4), reps=1) == {1: "per-shape", 4: "per-shape"}


def test_the_whole_forward_check_runs_a_row_only_kernel_on_rows_only(cache, monkeypatch):
    model = make_tiny_llama()
    weights = layouts.projection_weights(model)
    (col, *rows) = list(weights)
    # a row-only kernel: a native one where the library is built, else F.linear on the row layout
    # (the check under test is the whole forward's, whichever kernel computes the rows)
    name = next((n for n in native.VARIANTS if native.usable(n)), "linear")
    calls = []

    def counted(x, w, b):
        calls.append(layouts.stored_as(w))
        return CANDIDATES[name](x, w, b)

    monkeypatch.setitem(CANDIDATES, "counted", counted)
    monkeypatch.setitem(CANDIDATES, "slow", _slow)
    reads = kernels.reads
    monkeypatch.setattr(kernels, "reads", lambda k: ("row",) if k == "counted" else reads(k))
    # The shape stored transposed keeps its own (slow) choice when the row-only kernel is tried for all.
    shapes = {s: kernels.ShapePlan(by_bucket={2: "slow" if s == col else "counted"}) for s in weights}
    shapes[col].layout = "col"
    layouts.apply_layouts(model, {s: sp.layout for s, sp in shapes.items()})
    assert tuning.compose(model, shapes, buckets=(2,), reps=1, relayout=False) == {2: "linear"}
    assert calls and set(calls) == {"row"}
    assert layouts.stored_as(weights[col]) == "col"


def test_the_whole_forward_check_leaves_the_model_in_the_layouts_it_keeps(cache):
    model = make_tiny_llama()
    plan = kernel_plan(model, spec="tune")
    for p in layouts.all_projections(model):
        assert layouts.stored_as(p) == plan.shapes[tuple(p.shape)].layout
    for sp in plan.shapes.values():
        kept = [t for t in sp.ms if t.forward]
        assert sorted(t.rows for t in kept) == list(BUCKETS) and all(t.kernel and t.layout == sp.layout for t in kept)
    shapes = {s: kernels.ShapePlan(by_bucket={1: "linear"}, layout="col") for s in plan.shapes}
    kept = tuning.compose(model, shapes, buckets=(1,), reps=1)
    assert set(kept) == {1} and kept[1].removeprefix("rows:") in {*CANDIDATES, "per-shape"}
    for p in layouts.all_projections(model):
        assert layouts.stored_as(p) == shapes[tuple(p.shape)].layout


def test_a_session_reuses_the_held_plan_whatever_its_threads_count_says(cache):
    from verifier.engine import VerifierSession

    model = make_tiny_llama()
    plan = kernel_plan(model)
    files = sorted((cache / "kernels").glob("*.json"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # e.g. an executor thread that kept another count
        assert VerifierSession(model).backend.plan is plan
    finally:
        torch.set_num_threads(threads)
    assert sorted((cache / "kernels").glob("*.json")) == files  # nothing measured again


def test_a_choice_measured_on_other_native_kernels_is_measured_again(cache, monkeypatch, tmp_path):
    model = make_tiny_llama()
    weights = layouts.projection_weights(model)
    args = (model, weights, torch.float32, 2, torch.device("cpu"), False)
    ident, digest = plan_cache.key(*args)
    assert ident["native_source"] == native.source_digest()
    edited = tmp_path / "native_linear.c"
    edited.write_text(native.SOURCE.read_text() + "\n/* another version of the kernels */\n")
    monkeypatch.setattr(native, "SOURCE", edited)
    assert plan_cache.key(*args)[1] != digest


def _per_row(x, w, b):  # invariant by construction: each row its own call
    return torch.cat([F.linear(r[None], w, b) for r in x])


def _option(one_row_of_chunks: float) -> tuple[str, int, str]:
    """The invariant option kept for a shape where a chunked kernel runs 16 rows in
    ``one_row_of_chunks`` ms against a row-invariant kernel's 0.5 ms for one row (and 2x slower
    than the chunks' per-row rate beyond)."""
    w = torch.randn(16, 32).to(torch.bfloat16)
    buckets = (1, 16, 64)
    ms = {("chunky", "row", 1): 0.6, ("chunky", "row", 16): one_row_of_chunks, ("chunky", "row", 64): 4.0}
    ms |= {("native4x3", "row", 1): 0.5, ("native4x3", "row", 16): 2.0, ("native4x3", "row", 64): 8.0}
    best = tuning._best_per_bucket(ms, "row", buckets)
    cands = {"chunky": _per_row, "native4x3": _per_row}
    return tuning._invariant_option(cands, w, {"row": best}, ms, buckets)


def test_an_invariant_plan_never_pays_for_padding_on_a_one_token_step():
    # 16-row chunks win the summed slowdowns (2 + 1 + 1 against 1 + 2 + 2) but cost a one-token
    # step twice the row-invariant kernel's call: one token first keeps the unchunked kernel
    assert _option(1.0) == ("native4x3", 0, "row")
    # chunks that cost a one-token step no more than the slack allows stay eligible, and win
    assert _option(0.5 * tuning.ONE_ROW_SLACK) == ("chunky", 16, "row")


def test_one_row_chunks_stay_the_fallback_when_a_padded_chunk_times_faster_than_one_row():
    def leaky(x, w, b):  # fails the position check for every chunk of more than one row
        y = F.linear(x, w, b)
        return y + 1e-3 * torch.roll(y, 1, 0)

    w = torch.randn(32, 64).to(torch.bfloat16)
    buckets = (1, 2, 4)
    ms = {("linear", "row", 1): 1.0, ("linear", "row", 2): 0.5, ("linear", "row", 4): 0.6}  # noise: 2 rows < 1
    best = tuning._best_per_bucket(ms, "row", buckets)
    assert tuning._invariant_option({"linear": leaky}, w, {"row": best}, ms, buckets) == ("linear", 1, "row")


def test_a_row_invariant_kernel_runs_unchunked_not_in_padded_chunks_of_itself():
    # noise: two rows of the native kernel timed as fast as one, so 2-row chunks of it would win
    w = torch.randn(16, 32).to(torch.bfloat16)
    buckets = (1, 2, 4)
    ms = {("native4x3", "row", 1): 1.0, ("native4x3", "row", 2): 0.9, ("native4x3", "row", 4): 2.4}
    best = tuning._best_per_bucket(ms, "row", buckets)
    assert tuning._invariant_option({"native4x3": _per_row}, w, {"row": best}, ms, buckets) == ("native4x3", 0, "row")


class _ColdClock:
    """A fake ``time.perf_counter`` and kernels whose calls advance it by their cost: the cost a
    kernel is given warm (the previous call, of any kernel, had the same rows) or cold."""

    def __init__(self):
        self.now, self.last_rows = 0.0, None

    def perf_counter(self) -> float:
        return self.now

    def kernel(self, warm_ms: float, cold_ms: float):
        def call(x, w, b):
            self.now += 1e-3 * (warm_ms if x.shape[0] == self.last_rows else cold_ms)
            self.last_rows = x.shape[0]
            return F.linear(x, w, b)

        return call


def test_each_row_count_is_timed_in_its_own_round_so_a_kernel_slow_from_cold_caches_is_still_kept(monkeypatch):
    """A one-row call timed right after another kernel's 64-row call reads its cold-cache cost; timed
    in a round of one-row calls (after a warm-up call), it reads what a decode step pays. Here
    ``linear`` costs 1 ms warm and 3 ms cold, ``wxt`` 1.5 ms either way: ``linear`` is the faster at
    every row count."""
    clock = _ColdClock()
    monkeypatch.setattr(tuning, "time", clock)
    cands = {"linear": clock.kernel(1.0, 3.0), "wxt": clock.kernel(1.5, 1.5)}
    sp = tune_shape(torch.randn(16, 32), buckets=(1, 2, 64), candidates=cands, layouts=("row",))
    assert sp.by_bucket == {1: "linear", 2: "linear", 64: "linear"}
    assert {t.rows: v for t, v in sp.ms.items() if t.kernel == "linear"} == {1: 1.0, 2: 1.0, 64: 1.0}


def test_more_repetitions_than_a_round_holds_visit_the_row_counts_in_turn(monkeypatch):
    """Ten repetitions in rounds of five: each row count's round (a warm-up pass, then five timed
    passes over both candidates) twice, the row counts in turn, so drift falls on both."""
    monkeypatch.setattr(tuning, "ROUND_REPS", 5)
    calls: list[int] = []
    fns = {(name, rows): (lambda x: calls.append(x)) for name in ("a", "b") for rows in (1, 2)}
    ms = tuning._time(fns, {1: 1, 2: 2}, reps=10)
    assert calls == ([1] * 12 + [2] * 12) * 2
    assert set(ms) == set(fns)
