"""The native invariant attention (verifier/native_attention.c): equal to SDPA within rounding, a row's
bits independent of the rows beside it, of where its keys lie in the cache and of the thread count,
and chosen by the llama backend only where it is built."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.verifier.test_batch_invariance import make_wide_llama
from verifier import llama, native
from verifier.engine import VerifierSession

H, KV, D = 9, 3, 64

pytestmark = pytest.mark.skipif(
    not native.attention_usable(torch.bfloat16, torch.device("cpu"), D), reason=f"no native library: {native.why()}"
)


def _tree_mask(rng, past, n):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    mask = torch.zeros((n, past + n), dtype=torch.bool)
    mask[:, :past] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, past + j] = True
            j = parents[j]
    return mask, parents


def _sdpa(q, kv, mask):
    add = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    m = mask.shape[1]
    return F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        kv[0, :, :m].float()[None],
        kv[1, :, :m].float()[None],
        attn_mask=add[None, None],
        scale=D**-0.5,
        enable_gqa=True,
    )[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("past", [5, 63, 64, 200])  # within a block, at its edge, across blocks
def test_equals_sdpa_within_rounding_on_tree_masks(dtype, past):
    rng = random.Random(past)
    gen = torch.Generator().manual_seed(past)
    n = 24
    kv = torch.randn((2, KV, past + n + 3, D), generator=gen).to(dtype)
    q = torch.randn((n, H, D), generator=gen).to(dtype)
    mask, _ = _tree_mask(rng, past, n)
    out = native.attention(q, kv, *llama._row_keys(mask, past, n), D**-0.5)
    assert out.dtype == dtype and out.shape == (n, H, D)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), _sdpa(q, kv, mask), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_rows_bits_do_not_depend_on_its_neighbours_where_its_keys_lie_or_the_threads(dtype):
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    past, n = 150, 40
    kv = torch.randn((2, KV, past + n, D), generator=gen).to(dtype)
    q = torch.randn((n, H, D), generator=gen).to(dtype)
    mask, parents = _tree_mask(rng, past, n)
    full = native.attention(q, kv, *llama._row_keys(mask, past, n), D**-0.5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.attention(q, kv, *llama._row_keys(mask, past, n), D**-0.5), full)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 1, 17, n - 1):
        # The row alone, its keys laid out as a one-token step sees them: context, then its path in order.
        path = mask[r, past:].nonzero()[:, 0] + past
        alone = torch.cat((kv[:, :, :past], kv[:, :, path]), dim=2).contiguous()
        keys = llama._row_keys(None, alone.shape[2] - 1, 1)
        assert keys[1].item() == alone.shape[2] and keys[2].shape[1] == 0  # all in place
        assert torch.equal(native.attention(q[r : r + 1], alone, *keys, D**-0.5)[0], full[r]), f"row {r}"


def test_the_lean_backend_reads_the_context_in_place_and_falls_back_without_the_library(monkeypatch, tmp_path):
    monkeypatch.setenv("RACER_KERNELS", "linear:4")
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    model = make_wide_llama()
    s = VerifierSession(model, backend="llama")
    assert s.backend.native_attention and s.backend.pad_rows() == 0
    monkeypatch.setenv("RACER_NATIVE", "off")
    s = VerifierSession(model, backend="llama")
    assert not s.backend.native_attention and s.backend.pad_rows() == llama._KEY_BLOCK
    f32 = VerifierSession(make_wide_llama().float(), backend="llama")
    assert not f32.backend.native_attention  # float32 keeps the fused attention: HF greedy, not invariance
