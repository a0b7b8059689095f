"""The native invariant attention (verifier/native_attention.c): on each of its paths (AMX tiles where
the CPU has them, float32 vectors everywhere) equal to SDPA within rounding, a row's bits independent
of the rows beside it, of where its keys lie in the cache and of the thread count; one path per
process; chosen by the llama backend only where it is built."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.support.trees import random_tree
from tests.verifier.test_batch_invariance import make_wide_llama
from verifier import llama, machine, native
from verifier.engine import VerifierSession

H, KV, D = 9, 3, 64

pytestmark = pytest.mark.skipif(
    not native.attention_usable(torch.bfloat16, torch.device("cpu"), D), reason=f"no native library: {native.why()}"
)


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


def _cases():
    """(dtype, path) for every path that runs here: the vector one for every dtype, AMX for bfloat16
    where the CPU has it."""
    return [(d, p) for d in (torch.float32, torch.bfloat16, torch.float16) for p in native.attention_paths(d, H, KV, D)]


def test_the_amx_path_is_offered_exactly_where_the_cpu_has_amx_tiles():
    flags = machine.fingerprint()["flags"]
    amx = "amx_bf16" in flags and "amx_tile" in flags
    assert ("amx" in native.attention_paths(torch.bfloat16, H, KV, D)) == amx
    for dtype in (torch.float32, torch.float16):  # tiles multiply bfloat16 only
        assert native.attention_paths(dtype, H, KV, D) == ("vector",)
    assert native.attention_paths(torch.bfloat16, H, KV, 48) == ("vector",)  # heads of whole 32-dim tiles only


@pytest.mark.parametrize("dtype,path", _cases())
@pytest.mark.parametrize("past", [5, 63, 64, 200])  # within a block, at its edge, across blocks
def test_equals_sdpa_within_rounding_on_tree_masks(dtype, path, past):
    rng = random.Random(past)
    gen = torch.Generator().manual_seed(past)
    n = 24
    kv = torch.randn((2, KV, past + n + 3, D), generator=gen).to(dtype)
    q = torch.randn((n, H, D), generator=gen).to(dtype)
    mask, _ = random_tree(rng, past, n)
    out = native.attention(q, kv, *llama._row_keys(mask, past, n), D**-0.5, path=path)
    assert out.dtype == dtype and out.shape == (n, H, D)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), _sdpa(q, kv, mask), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,path", [c for c in _cases() if c[0] != torch.float32])
def test_a_rows_bits_do_not_depend_on_its_neighbours_where_its_keys_lie_or_the_threads(dtype, path):
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    past, n = 150, 40
    kv = torch.randn((2, KV, past + n, D), generator=gen).to(dtype)
    q = torch.randn((n, H, D), generator=gen).to(dtype)
    mask, parents = random_tree(rng, past, n)
    full = native.attention(q, kv, *llama._row_keys(mask, past, n), D**-0.5, path=path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.attention(q, kv, *llama._row_keys(mask, past, n), D**-0.5, path=path), full)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 1, 17, n - 1):
        # The row alone, its keys laid out as a one-token step sees them: context, then its path in order.
        path_keys = mask[r, past:].nonzero()[:, 0] + past
        alone = torch.cat((kv[:, :, :past], kv[:, :, path_keys]), dim=2).contiguous()
        keys = llama._row_keys(None, alone.shape[2] - 1, 1)
        assert keys[1].item() == alone.shape[2] and keys[2].shape[1] == 0  # all in place
        got = native.attention(q[r : r + 1], alone, *keys, D**-0.5, path=path)[0]
        assert torch.equal(got, full[r]), f"row {r}"
    # A chain's rows read their own block in place, the rows of a tree past a branch their own copy:
    # a 16-row chain's rows equal the same rows computed one at a time.
    chain = torch.arange(past + 1, past + 17, dtype=torch.long)
    many = native.attention(
        q[:16], kv, chain, chain.clone(), torch.zeros((16, 0), dtype=torch.long), D**-0.5, path=path
    )
    for r in (0, 7, 15):
        c = chain[r : r + 1]
        one = native.attention(
            q[r : r + 1], kv, c, c.clone(), torch.zeros((1, 0), dtype=torch.long), D**-0.5, path=path
        )
        assert torch.equal(one[0], many[r]), f"chain row {r}"


@pytest.mark.parametrize("dtype,path", [c for c in _cases() if c[0] != torch.float32])
@pytest.mark.parametrize("past", [40, 300, 700])  # one chunk of keys, two, three
def test_a_rows_bits_do_not_depend_on_how_many_rows_share_the_call_or_its_tile(dtype, path, past):
    """Rows of one call share the context's blocks and run several to a register tile: a row's bits
    are those it gets alone in the call with the same keys, whatever the call's size (each slot of
    tiles of every width), which rows are beside it, and how many threads split the call."""
    rng = random.Random(past)
    gen = torch.Generator().manual_seed(past)
    n = 15
    kv = torch.randn((2, KV, past + n, D), generator=gen).to(dtype)
    # Queries of the cache's dtype, passed as float32 so that the results come back unrounded: a
    # difference in the last float32 bit is not hidden by the rounding to the dtype.
    q = torch.randn((n, H, D), generator=gen).to(dtype).float()
    mask, _ = random_tree(rng, past, n)
    counts, inplace, tail = llama._row_keys(mask, past, n)

    def rows(idx, threads=None):
        idx = torch.tensor(idx)
        keys = (counts[idx].contiguous(), inplace[idx].contiguous(), tail[idx].contiguous())
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads or before)
            return native.attention(q[idx].contiguous(), kv, *keys, D**-0.5, path=path)
        finally:
            torch.set_num_threads(before)

    alone = torch.stack([rows([r])[0] for r in range(n)])
    for size in (2, 3, 5, 7, 8, 13, n):
        idx = rng.sample(range(n), size)
        assert torch.equal(rows(idx), alone[idx]), f"{size} rows {idx}"
    for threads in (1, 3):
        assert torch.equal(rows(list(range(n)), threads), alone), f"{threads} threads"


@pytest.mark.skipif(len(native.attention_paths(torch.bfloat16, H, KV, D)) < 2, reason="one attention path here")
def test_the_two_paths_differ_in_bits_so_a_process_keeps_one(monkeypatch):
    """Both paths agree with a float32 reference, not with each other bit for bit: mixing them within
    a process would break racer = off. The process's choice is made once and can be forced."""
    gen = torch.Generator().manual_seed(5)
    past, n = 300, 16
    kv = torch.randn((2, KV, past + n, D), generator=gen).to(torch.bfloat16)
    q = torch.randn((n, H, D), generator=gen).to(torch.bfloat16)
    mask, _ = random_tree(random.Random(5), past, n)
    keys = llama._row_keys(mask, past, n)
    amx, vec = (native.attention(q, kv, *keys, D**-0.5, path=p) for p in ("amx", "vector"))
    assert not torch.equal(amx, vec)
    ref = _sdpa(q, kv, mask)
    for out in (amx, vec):
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(native, "_paths_chosen", {})
    for forced in ("amx", "vector"):
        monkeypatch.setenv("RACER_ATTENTION", forced)
        native._paths_chosen.clear()
        assert native.attention_path(torch.bfloat16, H, KV, D) == forced
        assert torch.equal(native.attention(q, kv, *keys, D**-0.5), amx if forced == "amx" else vec)
    monkeypatch.delenv("RACER_ATTENTION")
    native._paths_chosen.clear()
    chosen = native.attention_path(torch.bfloat16, H, KV, D)
    assert chosen in ("amx", "vector") and native.attention_path(torch.bfloat16, H, KV, D) == chosen


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
