"""The native decoder (verifier/native_layer.c): every layer of a reduced-precision Llama in one call.

Where it runs, it is the only computation the model makes (prompts, one-token steps, trees, batches
of sessions), so a row's bits must be the same whatever shares the call and however many threads
run it, and they must still be a good approximation of a float32 forward
(test_batch_invariance.py checks that, on both paths).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.verifier.test_batch_invariance import VOCAB, _path, _session, _tree, _tree_hidden, make_wide_llama
from verifier import native
from verifier.engine import VerifierSession
from verifier.llama import forward_segments


def _widening_native() -> str | None:
    usable = [n for n in native.VARIANTS if n not in native.PAIRS and native.usable(n)]
    return usable[0] if usable else None


needs_native = pytest.mark.skipif(
    _widening_native() is None or not native.attention_usable(torch.bfloat16, torch.device("cpu"), 64),
    reason=f"native kernels not built here: {native.why()}",
)


@pytest.fixture(params=[(d, k) for d in ("bfloat16", "float16") for k in ("tile", "panel")])
def fused_model(request, monkeypatch, tmp_path):
    """A reduced-precision model whose projections run a native row tile, or the panel kernel over
    weights stored as panels."""
    dtype, kind = request.param
    spec = native.PANEL if kind == "panel" and native.panel_width() else _widening_native()
    monkeypatch.setenv("RACER_KERNELS", spec or "linear")
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    return make_wide_llama(dtype=getattr(torch, dtype))


def _step(session, token: int) -> torch.Tensor:
    ids, positions, mask = session._inputs([token], [-1])
    hidden = session.backend.forward(ids, positions, mask)
    session.backend.commit(None, 1)
    return hidden[0]


@needs_native
def test_a_rows_bits_equal_alone_in_a_tree_in_a_batch_and_on_one_thread(fused_model):
    rng = random.Random(3)
    prompt = [rng.randrange(3, VOCAB) for _ in range(70)]  # past one 64-key block
    tokens, parents = _tree(rng, 40)
    s = _session(fused_model, prompt)
    assert s.backend.fused is not None
    tree = _tree_hidden(s, tokens, parents)

    other = _session(fused_model, [rng.randrange(3, VOCAB) for _ in range(11)])
    segs = [
        (b.backend, *b._inputs(tk, pa))
        for b, tk, pa in [(other, *_tree(rng, 7)), (_session(fused_model, prompt), tokens, parents)]
    ]
    assert torch.equal(forward_segments(segs)[1], tree)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_tree_hidden(_session(fused_model, prompt), tokens, parents), tree)
    finally:
        torch.set_num_threads(threads)

    for i in (0, 5, 17, 39):
        alone = _session(fused_model, prompt)
        for j in _path(parents, i):
            hidden = _step(alone, tokens[j])
        assert torch.equal(hidden, tree[i]), f"node {i} differs from its one-token step"


@needs_native
def test_a_prompt_prefilled_at_once_computes_what_one_token_steps_do(fused_model):
    """Prefill runs the same exact computation: its last row and its K/V rows are a step's."""
    rng = random.Random(4)
    prompt = [rng.randrange(3, VOCAB) for _ in range(75)]
    whole = VerifierSession(fused_model, backend="llama")
    hidden = whole.backend.forward(*whole._prefill_inputs(prompt), rows_exact=False)
    whole.backend.commit(None, len(prompt))
    steps = _session(fused_model, prompt[:60])
    for t in prompt[60:]:
        last = _step(steps, t)
    assert torch.equal(hidden[-1], last)
    assert torch.equal(whole.backend.cache[:, :, :, : len(prompt)], steps.backend.cache[:, :, :, : len(prompt)])


@needs_native
def test_the_native_decoder_computes_other_bits_than_the_layers_op_by_op(fused_model):
    """Negative control: the tests above exercise the native decoder, not the op-by-op path (float32
    activations there, rounded ones here: the two differ, within the tolerance of a float32 forward
    checked in test_batch_invariance.py)."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, VOCAB) for _ in range(30)]
    tokens, parents = _tree(rng, 8)
    fused = _session(fused_model, prompt)
    plain = VerifierSession(fused_model, backend="llama")
    plain.backend.fused = None
    plain.prefill(prompt)
    a, b = _tree_hidden(fused, tokens, parents), _tree_hidden(plain, tokens, parents)
    assert not torch.equal(a, b)
    assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max()


def test_not_taken_where_a_projection_runs_chunks(monkeypatch, tmp_path):
    monkeypatch.setenv("RACER_KERNELS", "linear:4")
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    assert VerifierSession(make_wide_llama(), backend="llama").backend.fused is None


def test_float32_never_takes_it(monkeypatch, tmp_path):
    monkeypatch.setenv("RACER_KERNELS", _widening_native() or "linear")
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    assert VerifierSession(make_wide_llama(dtype=torch.float32), backend="llama").backend.fused is None


@needs_native
def test_the_default_model_takes_it_in_bfloat16():
    from verifier.model import DEFAULT_MODEL, load

    backend = VerifierSession(load(DEFAULT_MODEL, dtype="bfloat16", tokenizer=False).model, backend="llama").backend
    assert backend.fused is not None, backend.plan.describe()


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("arch", ["sapphirerapids", "x86-64-v2"])
def test_the_sources_build_for_cpus_other_than_this_one(tmp_path, arch):
    """The AVX-512 (and AMX) code and the generic fallbacks compile, though this CPU runs neither."""
    import subprocess

    flags = [f if f != "-march=native" else f"-march={arch}" for f in native.FLAGS]
    objects = {p: tmp_path / f"{p.stem}.o" for p in native.sources()}
    compiles = {  # each source compiled on its own, side by side, then linked together
        p: subprocess.Popen([native._compiler(), *flags, "-c", str(p), "-o", str(o)], stderr=subprocess.PIPE, text=True)
        for p, o in objects.items()
    }
    for p, proc in compiles.items():
        err = proc.communicate(timeout=300)[1]
        assert proc.returncode == 0, f"{p.name}: {err[-2000:]}"
    cmd = [native._compiler(), *flags, *map(str, objects.values()), "-o", str(tmp_path / "lib.so")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_native
def test_projection_biases_are_added_by_the_native_decoder(monkeypatch, tmp_path):
    """The biased Llama family: taken, a tree node's bits are its one-token step's, and the hidden
    states stay close to the op-by-op path's (which adds the biases in torch)."""
    from tests.support.families import model

    monkeypatch.setenv("RACER_KERNELS", _widening_native())
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    m = copy.deepcopy(model("llama-biases")).to(torch.bfloat16)  # the family's model is shared: not changed
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the family's biases are zeros: nothing would tell a dropped one
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    rng = random.Random(6)
    prompt = [rng.randrange(3, 60) for _ in range(20)]
    tokens, parents = [rng.randrange(3, 60) for _ in range(6)], [-1, 0, 0, 1, 3, 2]
    s = _session(m, prompt)
    assert s.backend.fused is not None
    tree = _tree_hidden(s, tokens, parents)
    alone = _session(m, prompt)
    for j in _path(parents, 4):
        hidden = _step(alone, tokens[j])
    assert torch.equal(hidden, tree[4])
    plain = VerifierSession(m, backend="llama")
    plain.backend.fused = None
    plain.prefill(prompt)
    ref = _tree_hidden(plain, tokens, parents).float()
    assert (tree.float() - ref).abs().max() <= 0.05 * ref.abs().max()


@needs_native
def test_a_tuned_chunked_shape_runs_the_fastest_native_tile_a_forced_one_falls_back():
    from verifier.kernels import ShapePlan, Timing
    from verifier.llama import _decoder_tile

    usable = [n for n in native.VARIANTS if n not in native.PAIRS and native.usable(n)]
    ms = {Timing(k, "row", 1): 1.0 + i for i, k in enumerate(usable)} | {Timing("linear", "row", 1): 0.1}
    sp = ShapePlan(kernel="linear", rows=2, ms=ms)
    assert _decoder_tile(sp, chosen=True) == usable[0]
    assert _decoder_tile(sp, chosen=False) is None
    assert _decoder_tile(ShapePlan(kernel=usable[-1]), chosen=False) == usable[-1]
