"""Reduced precision: a row's bits do not depend on what shares its forward (tree nodes, sessions).

The contract this buys (docs/design/round.md, Exactness): in bfloat16 speculation never changes what the engine
produces, because every tree node's hidden state, logits and K/V rows are bit-identical to those a
one-token step at that position computes.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.models import make_tiny_llama
from verifier import native
from verifier.engine import VerifierSession
from verifier.llama import forward_segments
from verifier.tuning import kernel_plan

VOCAB = 96


def make_wide_llama(seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A small random Llama with SmolLM2's head size (64) in bfloat16. With the tiny model's 16-wide
    heads the fused forward happens to be invariant on a CPU too; with these it is not (CPU SDPA's
    row results depend on the query count and key length), so these tests can tell the difference
    (``test_the_identity_fails_with_invariance_switched_off``)."""
    return make_tiny_llama(seed, VOCAB, hidden=256).to(dtype)


def _native_spec() -> str:
    """A native kernel unchunked (row-invariant by construction), or chunks where none is built."""
    usable = [n for n in native.VARIANTS if n not in native.PAIRS and native.usable(n)]
    return usable[0] if usable else "linear:4"


def _panel_spec() -> str:
    """The panel kernel over weights stored as panels, or chunks where it is not built."""
    return native.PANEL if native.panel_width() else "linear:4"


@pytest.fixture(
    scope="module",
    params=[(s, d) for d in ("bfloat16", "float16") for s in ("linear:4", "native", "panel", "auto")],
)
def bf16_model(request, tmp_path_factory):
    """A reduced-precision model (bfloat16, float16) with 4-row chunks forced, a native row tile
    forced (unchunked), the panel kernel forced (weights stored as panels), and the tuned choice."""
    spec, dtype = request.param
    mp = pytest.MonkeyPatch()
    mp.setenv("RACER_KERNELS", {"native": _native_spec(), "panel": _panel_spec()}.get(spec, spec))
    mp.setenv("RACER_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield make_wide_llama(dtype=getattr(torch, dtype))
    mp.undo()


def _tree(rng, n):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return [rng.randrange(3, VOCAB) for _ in range(n)], parents


def _session(model, prompt, invariant: bool = True):
    """``invariant=False``: the same backend with invariance switched off (the fastest kernels per row
    count, fused attention over all rows): the negative control."""
    s = VerifierSession(model, backend="llama")
    if not invariant:
        s.backend.plan = kernel_plan(model, invariant=False, spec="linear")
        s.backend.invariant = s.backend.native_attention = False
    s.prefill(prompt)
    return s


def _path(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def _stepwise(model, prompt, tokens, invariant: bool = True):
    """Hidden state and logits of the last of ``tokens`` fed one by one (each step committed)."""
    s = _session(model, prompt, invariant)
    for t in tokens:
        ids, positions, mask = s._inputs([t], [-1])
        hidden = s.backend.forward(ids, positions, mask)
        s.backend.commit(None, 1)
    return hidden[0], s.backend.logits(hidden)[0]


def _tree_hidden(session, tokens, parents):
    ids, positions, mask = session._inputs(tokens, parents)
    return session.backend.forward(ids, positions, mask)


def test_a_row_is_bit_identical_alone_in_a_64_node_tree_and_in_a_batch(bf16_model):
    rng = random.Random(0)
    prompt = [rng.randrange(3, VOCAB) for _ in range(45)]
    tokens, parents = _tree(rng, 64)
    tree = _tree_hidden(_session(bf16_model, prompt), tokens, parents)
    tree_logits = _session(bf16_model, prompt).backend.logits(tree)

    # The same tree among other sessions' trees in one forward (sizes chosen to shift its rows).
    others = [
        (_session(bf16_model, [rng.randrange(3, VOCAB) for _ in range(k)]), *_tree(rng, m))
        for k, m in ((9, 5), (40, 23))
    ]
    mine = _session(bf16_model, prompt)
    segs = []
    for s, tk, pa in [others[0], (mine, tokens, parents), others[1]]:
        ids, positions, mask = s._inputs(tk, pa)
        segs.append((s.backend, ids, positions, mask))
    batched = forward_segments(segs)[1]
    assert torch.equal(batched, tree)

    checked = 0
    for i in sorted(rng.sample(range(64), 8)) + [63]:
        path = _path(parents, i)
        alone, logits = _stepwise(bf16_model, prompt, [tokens[j] for j in path])
        assert torch.equal(alone, tree[i]), f"node {i} (depth {len(path) - 1}) differs from its one-token step"
        assert torch.equal(logits, tree_logits[i])
        checked += 1
    assert checked == 9


def test_kv_rows_kept_from_a_tree_equal_those_of_one_token_steps(bf16_model):
    rng = random.Random(1)
    prompt = [rng.randrange(3, VOCAB) for _ in range(30)]
    tokens, parents = _tree(rng, 32)
    keep = _path(parents, 31)
    s = _session(bf16_model, prompt)
    _tree_hidden(s, tokens, parents)
    s.backend.commit(keep, len(tokens))
    ref = _session(bf16_model, prompt)
    for j in keep:
        ids, positions, mask = ref._inputs([tokens[j]], [-1])
        ref.backend.forward(ids, positions, mask)
        ref.backend.commit(None, 1)
    assert s.length == ref.length
    assert torch.equal(s.backend.cache[:, :, :, : s.length], ref.backend.cache[:, :, :, : ref.length])


def test_float32_keeps_the_fastest_kernels_and_no_row_chunks():
    s = VerifierSession(make_tiny_llama(), backend="llama")
    assert not s.backend.invariant and not s.backend.plan.invariant


def _differing_nodes(model, invariant: bool) -> list[int]:
    """Tree nodes whose hidden state differs from their one-token step's (the identity checked above)."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, VOCAB) for _ in range(70)]
    tokens, parents = _tree(rng, 48)
    tree = _tree_hidden(_session(model, prompt, invariant), tokens, parents)
    out = []
    for i in range(0, 48, 3):
        path = _path(parents, i)
        alone, _ = _stepwise(model, prompt, [tokens[j] for j in path], invariant)
        if not torch.equal(alone, tree[i]):
            out.append(i)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_identity_fails_with_invariance_switched_off(monkeypatch, tmp_path, dtype):
    """Negative control: on this model the bit-identity does not come for free. With the invariant
    kernels and attention it holds; switched off (fused attention, fastest kernels) it fails."""
    monkeypatch.setenv("RACER_KERNELS", "linear:4")
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    model = make_wide_llama(dtype=dtype)
    assert _differing_nodes(model, invariant=True) == []
    assert _differing_nodes(model, invariant=False), "invariance off, yet every node equals its one-token step"


TOLERANCE = 0.02  # of the float32 logits' largest magnitude


def _peaked_wide_llama(dtype: torch.dtype):
    """The wide model with its query and key weights times 4 (exact: a power of two), so scores are
    16x and attention is peaked, as in a trained model. With the random weights' flat attention an
    error in it hardly reaches the logits: a softmax scale 1.5x too large moved none past the
    tolerance."""
    model = make_wide_llama(dtype=dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return model


def _logit_errors(dtype: torch.dtype, scale_error: float = 1.0, fused: bool = False) -> list[tuple[float, bool]]:
    """Per node of a 32-node tree: the largest difference of its reduced-precision logits from Hugging
    Face's own float32 forward of the same rounded weights over the node's path (a fraction of the
    reference's largest logit), and whether its top token differs where the reference's top two are
    apart by more than the tolerance. ``scale_error``: the engine's softmax scale multiplied by it.
    ``fused``: whether the native decoder must be the path taken (else the layers op by op)."""
    model = _peaked_wide_llama(dtype)
    ref_model = _peaked_wide_llama(dtype).float()
    for layer in model.model.layers:
        layer.self_attn.scaling *= scale_error
    rng = random.Random(7)
    prompt = [rng.randrange(3, VOCAB) for _ in range(90)]
    tokens, parents = _tree(rng, 32)
    s = _session(model, prompt)
    assert (s.backend.fused is not None) == fused
    logits = s.backend.logits(_tree_hidden(s, tokens, parents)).float()
    out = []
    with torch.inference_mode():
        for i in range(32):
            seq = prompt + [tokens[j] for j in _path(parents, i)]
            ref = ref_model(torch.tensor([seq])).logits[0, -1]
            top = ref.abs().max().item()
            top2 = torch.topk(ref, 2).values
            clear = (top2[0] - top2[1]).item() > TOLERANCE * top
            out.append(
                ((logits[i] - ref).abs().max().item() / top, clear and int(logits[i].argmax()) != int(ref.argmax()))
            )
    return out


# "linear:4": the layers op by op; a native kernel: every layer in one native call where it is built.
PATHS = ["linear:4", _native_spec()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", PATHS)
def test_reduced_precision_logits_agree_with_a_float32_hf_forward(monkeypatch, tmp_path, dtype, spec):
    """A reference outside the engine: a tree's logits in reduced precision against Hugging Face's
    own float32 forward of the same weights over each node's path. Stated tolerance: every logit
    within 2% of the largest logit's magnitude, and the same top token wherever the float32 top two
    are apart by more than that."""
    monkeypatch.setenv("RACER_KERNELS", spec)
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    for i, (error, flipped) in enumerate(_logit_errors(dtype, fused=spec in native.VARIANTS)):
        assert error <= TOLERANCE, f"node {i}: {error:.4f} of the largest logit"
        assert not flipped, f"node {i}: another top token"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", PATHS)
def test_the_tolerance_catches_an_attention_error(monkeypatch, tmp_path, dtype, spec):
    """Negative control of the agreement above: with the softmax scale 5% off, some node's logits
    leave the tolerance (the comparison can fail)."""
    monkeypatch.setenv("RACER_KERNELS", spec)
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    errors = _logit_errors(dtype, scale_error=1.05, fused=spec in native.VARIANTS)
    assert max(error for error, _ in errors) > TOLERANCE
