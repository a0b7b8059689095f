"""GGUF weights served as the file stores them (verifier/gguf_blocks.py, native_quant.c).

The block kernel multiplies 8-bit activations with each format's blocks as integers, every float32
step in a fixed order: checked against a float64 product of the file's dequantized values within
the bound of that arithmetic, for a row's bits alone, among 40 rows and at 1 and 2 threads, and with
a negative control. Then the same through the native decoder of a small Llama whose projections a
GGUF file holds in each format, a format the kernel does not take falling back with a log line, and
the bundled model: its blocks hold exactly the values Hugging Face dequantizes, and speculation
never changes its output.
"""

from __future__ import annotations

import logging
import random

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from tests.verifier.test_batch_invariance import VOCAB, _path, _session, _tree, _tree_hidden
from tests.verifier.test_native_decoder import _step
from verifier import gguf_blocks, native
from verifier.llama import forward_segments

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
PACKABLE = FORMATS
QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the formats gguf's own quantizer writes
# each format as the file stores its rows, and packed 8 rows a group
LAYOUTS = [(name, False) for name in FORMATS] + [(name, True) for name in PACKABLE]

needs_kernel = pytest.mark.skipif(not native.quant_supported(3), reason=f"native kernels not built: {native.why()}")


def _kind(name: str) -> gguf.GGMLQuantizationType:
    return getattr(gguf.GGMLQuantizationType, name)


def _blocks(name: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """A weight [n, k] in format ``name``: uint8 [n, row bytes]. The 32-value formats quantize a
    random weight (gguf's own quantizer); the K-quants (which it does not quantize) are random
    blocks with small float16 scales."""
    if name in QUANTIZED:
        return quants.quantize((rng.standard_normal((n, k)) * scale).astype(np.float32), _kind(name))
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[name]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    if name in ("Q4_K", "Q5_K"):  # d, dmin float16 first
        raw[:, :, 0:2] = np.frombuffer(np.float16(scale / 400).tobytes(), np.uint8)
        raw[:, :, 2:4] = np.frombuffer(np.float16(scale / 100).tobytes(), np.uint8)
    else:  # d float16 last
        raw[:, :, 208:210] = np.frombuffer(np.float16(scale / 2000).tobytes(), np.uint8)
    return raw.reshape(n, -1)


def _dequantized(name: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, _kind(name)).astype(np.float32))


def _weight(name: str, raw: np.ndarray, n: int, k: int, packed: bool) -> tuple[int, torch.Tensor]:
    kind, data = int(_kind(name)), torch.from_numpy(raw.copy())
    if not packed:
        return kind, data
    got = native.quant_pack(kind, data, n, k)
    assert got is not None
    return got


def _run(
    x: torch.Tensor, name: str, raw: np.ndarray, n: int, k: int, threads: int = 2, packed: bool = False, **kw
) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return native.quant_linear(x, *_weight(name, raw, n, k, packed), n, k, **kw)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("name,packed", LAYOUTS)
def test_the_kernel_is_the_files_weight_times_8_bit_activations(name, packed):
    """Within the bound of its arithmetic: each activation within half a step of its 8-bit value
    (max |x| / 254 per block of 32), the float32 sums a small relative error on top. The file's
    values themselves are read exactly (its rows dequantized by the kernel are gguf's)."""
    rng = np.random.default_rng(0)
    n, k = 48, 512
    raw = _blocks(name, n, k, rng)
    w = _dequantized(name, raw).double()
    assert torch.equal(native.quant_rows(*_weight(name, raw, n, k, packed), torch.arange(n), k), w.float())
    x = torch.randn((40, k), generator=torch.Generator().manual_seed(1))
    y = _run(x, name, raw, n, k, packed=packed).double()
    ref = x.double() @ w.T
    step = x.double().view(40, k // 32, 32).abs().amax(-1) / 254  # [M, blocks]
    bound = step @ w.abs().view(n, k // 32, 32).sum(-1).T + 1e-5 * (x.double().abs() @ w.abs().T)
    assert ((y - ref).abs() <= bound).all(), ((y - ref).abs() / bound).max()
    assert (y - ref).abs().max() > 0  # 8-bit activations: not the float product


@needs_kernel
@pytest.mark.parametrize("name,packed", LAYOUTS)
def test_a_rows_bits_equal_alone_among_40_rows_and_at_1_and_2_threads(name, packed):
    rng = np.random.default_rng(2)
    n, k = 40, 768 if "K" in name else 544  # 40 weight rows (5 groups of 8): threads split them unevenly
    raw = _blocks(name, n, k, rng)
    x = torch.randn((40, k), generator=torch.Generator().manual_seed(3))  # more rows than a pass holds
    many = _run(x, name, raw, n, k, threads=2, packed=packed)
    assert torch.equal(_run(x, name, raw, n, k, threads=1, packed=packed), many)
    for r in (0, 1, 6, 21, 39):
        assert torch.equal(_run(x[r : r + 1], name, raw, n, k, threads=1, packed=packed)[0], many[r])
    assert torch.equal(_run(x[5:12], name, raw, n, k, threads=2, packed=packed), many[5:12])


@needs_kernel
@pytest.mark.parametrize("name", PACKABLE)
def test_long_runs_and_runs_of_4_groups_give_the_same_bits(name):
    """How a call hands out its groups to the threads (``native.quant_stream_rows``) changes no value:
    a call of 1, 3 or 17 rows, 2 threads, by long runs and by runs of 4, equal bits."""
    rng = np.random.default_rng(11)
    n, k = 8 * 37, 512 if "K" in name else 544  # 37 groups: neither handout divides them evenly
    raw = _blocks(name, n, k, rng)
    x = torch.randn((17, k), generator=torch.Generator().manual_seed(12))
    try:
        for rows in (1, 3, 17):
            got = {}
            for stream in (0, 32):
                native.quant_stream_rows(stream)
                got[stream] = _run(x[:rows], name, raw, n, k, threads=2, packed=True)
            assert torch.equal(got[0], got[32]), rows
    finally:
        native.quant_stream_rows(0)


def test_the_long_runs_row_count_is_the_last_one_they_win_at(monkeypatch):
    """``block_stream_rows`` times the model's packed projections both ways, row count after row
    count, and keeps the last count where long runs were faster: here (a clock that advances by the
    cost of each call) up to 4 rows, where they cost 0.9 against 1; from 8 rows on 1.1."""
    from types import SimpleNamespace

    from verifier import tuning

    setting = {"rows": 0}
    clock = {"t": 0.0}
    calls = []

    def matmul(x):
        rows = x.shape[0]
        long_runs = rows <= setting["rows"]
        clock["t"] += 1.0 if not long_runs else (0.9 if rows <= 4 else 1.1)
        calls.append(rows)
        return x

    proj = SimpleNamespace(racer_blocks=SimpleNamespace(kind=native.PACKED + 3, k=64, matmul=matmul))
    model = SimpleNamespace(modules=lambda: [proj, SimpleNamespace()])
    monkeypatch.setattr(native, "quant_stream_rows", lambda rows: setting.update(rows=rows))
    assert tuning.block_stream_rows(model, reps=3, clock=lambda: clock["t"]) == 4
    assert setting["rows"] == 4  # set for the process
    assert sorted(set(calls)) == [1, 2, 4, 8]  # 16 was not tried once 8 lost
    no_blocks = SimpleNamespace(modules=lambda: [SimpleNamespace()])
    assert tuning.block_stream_rows(no_blocks) == 0 and setting["rows"] == 0


def test_the_amx_row_count_is_the_first_one_the_tiles_win_at_and_none_without_amx(monkeypatch):
    """``block_amx_rows`` times the model's packed projections on tiles and on vectors, row count
    after row count, and keeps the first count where the tiles were faster (here 4: 1.2 against 1 at
    2 rows, 0.8 from 4 on); without AMX (``native.quant_amx`` false) it times nothing and sets 0."""
    from types import SimpleNamespace

    from verifier import tuning

    setting = {"rows": 0}
    clock = {"t": 0.0}
    calls = []

    def matmul(x):
        rows = x.shape[0]
        clock["t"] += 1.0 if not setting["rows"] else (1.2 if rows < 4 else 0.8)
        calls.append(rows)
        return x

    proj = SimpleNamespace(racer_blocks=SimpleNamespace(kind=native.PACKED + 3, k=64, matmul=matmul))
    model = SimpleNamespace(modules=lambda: [proj, SimpleNamespace()])
    monkeypatch.setattr(native, "quant_amx_rows", lambda rows: setting.update(rows=rows))
    monkeypatch.setattr(native, "quant_amx", lambda: True)
    assert tuning.block_amx_rows(model, reps=3, clock=lambda: clock["t"]) == 4
    assert setting["rows"] == 4  # set for the process
    assert sorted(set(calls)) == [2, 4]  # 8 and 16 not tried once 4 won

    monkeypatch.setattr(native, "quant_amx", lambda: False)
    calls.clear()
    assert tuning.block_amx_rows(model, reps=3, clock=lambda: clock["t"]) == 0
    assert setting["rows"] == 0 and calls == []


@needs_kernel
@pytest.mark.parametrize("name", PACKABLE)
def test_packed_groups_vector_code_gives_the_c_codes_bits(name):
    """The vector code (8 weight rows in a vector's lanes) does each output's float32 steps exactly
    as the C code does them: equal bits, a bias included, on any build."""
    rng = np.random.default_rng(7)
    n, k = 24, 512 if "K" in name else 320
    raw = _blocks(name, n, k, rng)
    x = torch.randn((19, k), generator=torch.Generator().manual_seed(8))
    b = torch.randn(n, generator=torch.Generator().manual_seed(9))
    simd = _run(x, name, raw, n, k, packed=True, b=b)
    assert torch.equal(_run(x, name, raw, n, k, packed=True, b=b, reference=True), simd)
    assert not torch.equal(_run(x, name, raw, n, k, packed=True), simd)  # the bias is in it


def _edge_activations(k: int) -> torch.Tensor:
    """Rows whose blocks of 32 test the activations' 8-bit rounding at its edges: an all-zero block,
    values that land exactly halfway between two steps (max |x| 127, so each value is its own step
    count: ties go to the even neighbour), one lone value, tiny values, a block of one sign; the
    other blocks random, some large."""
    x = torch.randn((3, k), generator=torch.Generator().manual_seed(11))
    x[0, 0:32] = 0.0
    x[0, 32:64] = torch.arange(32) - 15.5
    x[0, 32] = 127.0
    x[1, 32:64] = -(torch.arange(32) - 15.5)
    x[1, 63] = -127.0
    x[0, 64:96] = 0.0
    x[0, 70] = -3.0
    x[1, 0:32] = torch.rand(32, generator=torch.Generator().manual_seed(12)) * 1e-30
    x[1, 64:96] = -torch.rand(32, generator=torch.Generator().manual_seed(13))
    x[2] *= 1e3
    return x


@needs_kernel
@pytest.mark.parametrize("name,packed", [("Q4_1", False), ("Q8_0", True), ("Q4_1", True), ("Q6_K", True)])
def test_the_activations_rounding_is_the_c_codes_at_ties_zeros_and_extremes(name, packed):
    """The vector build quantizes each block of activations (its maximum, the rounding to nearest
    even, the sums of its values and of its first half) as the reference build's C loops do: equal
    outputs at the rounding's edges, for the kernel over rows as stored and over packed groups."""
    rng = np.random.default_rng(14)
    n, k = 16, 512
    raw = _blocks(name, n, k, rng)
    x = _edge_activations(k)
    mine = _run(x, name, raw, n, k, packed=packed)
    kernel = f"quant {name}{' packed' if packed else ''}"
    assert not native.refused(kernel), f"the start-up check refused {kernel}"
    assert torch.equal(_run(x, name, raw, n, k, packed=packed, reference=True), mine)
    moved = x.clone()
    moved[0, 33] = -14.5 - 2**-18  # just past the tie: -15 where the tie gave -14
    assert not torch.equal(_run(moved, name, raw, n, k, packed=packed), mine)


@needs_kernel
@pytest.mark.parametrize("name", PACKABLE)
def test_a_groups_bits_are_the_same_paired_with_its_neighbour_or_alone(name):
    """The vector code takes two neighbouring groups of 8 weight rows at once (each broadcast of x
    serving 16 rows; 16 lanes with AVX-512) and a group left over alone: each group's outputs are the
    same bits either way, as a weight of its 8 rows alone gives them, at 1 to 9 rows of x and on 1
    and 2 threads."""
    rng = np.random.default_rng(21)
    n, k = 24, 512 if "K" in name else 320  # 3 groups: a pair and one left over
    raw = _blocks(name, n, k, rng)
    x = torch.randn((9, k), generator=torch.Generator().manual_seed(22))
    for m in (1, 2, 3, 5, 9):
        for threads in (1, 2):
            whole = _run(x[:m], name, raw, n, k, threads=threads, packed=True)
            for g in range(3):
                alone = _run(x[:m], name, np.ascontiguousarray(raw[8 * g : 8 * g + 8]), 8, k, threads=1, packed=True)
                assert torch.equal(alone, whole[:, 8 * g : 8 * g + 8]), (m, threads, g)


EXTREME = ("Q5_0", "Q5_1", "Q5_K", "Q4_K", "Q6_K")  # the widest values, the K-quants' scales


def _extreme_blocks(name: str, n: int, k: int) -> np.ndarray:
    """A weight [n, k] whose rows hold the format's extreme values: row 0 every value bit set (5-bit
    31, Q4_K 15, Q6_K 63, standing for 31), row 1 every value 0 (Q6_K: -32), the others alternating
    blocks of both. The K-quants' scales at their extremes too: Q4_K's and Q5_K's sub-block scales
    and minimums 63, Q6_K's -128. Scales 2^-7 (Q6_K 2^-10), Q5_1's minimum -2^-4, the K-quants' dmin
    2^-10: exact in float16."""
    sizes = {"Q5_0": (22, 32), "Q5_1": (24, 32), "Q5_K": (176, 256), "Q4_K": (144, 256), "Q6_K": (210, 256)}
    size, values = sizes[name]
    head, tail = {"Q5_0": 2, "Q5_1": 4, "Q5_K": 16, "Q4_K": 16, "Q6_K": 0}[name], {"Q6_K": 192}.get(name, size)
    high = np.zeros(size, np.uint8)
    high[head:tail] = 0xFF
    low = high.copy()
    low[head:tail] = 0
    for blk in (high, low):
        if name == "Q6_K":
            blk[192:208] = 0x80  # int8 -128
            blk[208:210] = np.frombuffer(np.float16(2.0**-10).tobytes(), np.uint8)
            continue
        if "K" in name:  # sub-block scales and minimums 63, their 6-bit packing all ones
            blk[4:16] = 0xFF
        blk[0:2] = np.frombuffer(np.float16(2.0**-7).tobytes(), np.uint8)
        if name != "Q5_0":
            blk[2:4] = np.frombuffer(np.float16(-(2.0**-4) if name == "Q5_1" else 2.0**-10).tobytes(), np.uint8)
    nb = k // values
    rows = np.empty((n, nb, size), np.uint8)
    rows[0], rows[1] = high, low
    for r in range(2, n):
        for b in range(nb):
            rows[r, b] = high if (r + b) % 2 else low
    return rows.reshape(n, -1)


@needs_kernel
@pytest.mark.parametrize("name,packed", [(n, p) for n, p in LAYOUTS if n in EXTREME])
def test_values_at_their_extremes_never_saturate_the_integer_sums(name, packed):
    """The largest integer sums a block makes: every value at its widest against activations all +127
    or all -127 (x = +-1 quantizes exactly): a 5-bit block's 32 products of 31 x 127 = 125,984, past
    what 16 bits hold (the vector code's pairwise sums must widen in time); the K-quants' sums times
    their sub-block scales (Q6_K: 32 x 32 x 127 x 128 a sub-block). The result is the exact product
    but for float32 rounding; on both paths, the C code's bits too."""
    n, k = 16, 512
    raw = _extreme_blocks(name, n, k)
    w = _dequantized(name, raw).double()
    x = torch.ones((3, k))
    x[1] = -1
    x[2, ::2] = -1
    y = _run(x, name, raw, n, k, packed=packed)
    err = (y.double() - x.double() @ w.T).abs()
    assert (err <= 1e-5 * (x.double().abs() @ w.abs().T)).all(), err.max()
    assert torch.equal(_run(x, name, raw, n, k, packed=packed, reference=True), y)


@needs_kernel
@pytest.mark.parametrize("name", PACKABLE)
def test_packing_moves_the_files_bytes_and_keeps_its_values(name):
    """A packed group holds its 8 rows' bytes, each once (moved, not widened; the 5-bit formats' fifth
    bits reordered within each row's word: the words' bits counted; the K-quants' bits moved within
    their super-block, and only their 6-bit scales widened to a byte); unpacked, its rows are the
    file's values bit for bit; and its kernel, which sums each block's products as one integer where
    the rows' kernel keeps 8 partial sums, agrees with the rows' kernel within float32 rounding."""
    rng = np.random.default_rng(14)
    n, k = 24, 512 if "K" in name else 320
    raw = _blocks(name, n, k, rng)
    kind, packed = _weight(name, raw, n, k, packed=True)
    # a K-quant's 6-bit scales and minimums (12 bytes a row's super-block) take a byte each (16)
    unpacked_scales = {"Q4_K": 4, "Q5_K": 4}.get(name, 0) * (k // 256)
    assert packed.shape == (n // 8, 8 * (raw.shape[1] + unpacked_scales))
    size = raw.shape[1] // (k // 32)
    file_bits, group_bits = {"Q5_0": (2, 144), "Q5_1": (4, 160)}.get(name, (0, 0))  # where the words lie
    for g in range(n // 8 if "K" not in name else 0):
        rows = raw[8 * g : 8 * g + 8].reshape(8, k // 32, size)
        group = packed[g].numpy().reshape(k // 32, 8 * size)
        if file_bits:
            words, rows = rows[:, :, file_bits : file_bits + 4], np.delete(rows, range(file_bits, file_bits + 4), 2)
            reordered = group[:, group_bits : group_bits + 32]
            group = np.delete(group, range(group_bits, group_bits + 32), 1)
            for b in range(k // 32):  # per block, the 8 rows' fifth bits
                assert np.unpackbits(words[:, b]).sum() == np.unpackbits(reordered[b]).sum()
        assert np.array_equal(np.sort(group.reshape(-1)), np.sort(rows.reshape(-1)))
    ids = torch.tensor([0, 7, 8, 13, 23, 2])
    values = _dequantized(name, raw)[ids]
    assert torch.equal(native.quant_rows(kind, packed, ids, k), values)
    assert torch.equal(native.quant_rows(int(_kind(name)), torch.from_numpy(raw), ids, k), values)
    x = torch.randn((9, k), generator=torch.Generator().manual_seed(15))
    rows, groups = _run(x, name, raw, n, k), _run(x, name, raw, n, k, packed=True)
    w = _dequantized(name, raw).double()
    assert ((rows.double() - groups.double()).abs() <= 1e-5 * (x.double().abs() @ w.abs().T)).all()


@needs_kernel
@pytest.mark.parametrize("name,packed", LAYOUTS)
def test_a_changed_activation_row_is_caught(name, packed):
    """Negative control: one value of one row changed changes that row's results, and no other's."""
    rng = np.random.default_rng(4)
    n, k = 32, 512
    raw = _blocks(name, n, k, rng)
    x = torch.randn((16, k), generator=torch.Generator().manual_seed(5))
    y = _run(x, name, raw, n, k, packed=packed)
    x2 = x.clone()
    x2[9, 100] += 0.25
    y2 = _run(x2, name, raw, n, k, packed=packed)
    assert not torch.equal(y2[9], y[9])
    assert torch.equal(torch.cat((y2[:9], y2[10:])), torch.cat((y[:9], y[10:])))


# -- a small Llama served from a GGUF file ------------------------------------------------------------


_FILE_NAMES = {v: k for k, v in gguf_blocks._NAMES.items()}


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a q or k weight's rows (what ``unpermute`` undoes)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _gguf_llama(tmp_path, name: str, other: str | None = None):
    """A small Llama (SmolLM2's 64-wide heads) whose projections and output layer a GGUF file holds
    in format ``name`` (``other``: its down projections in that format instead), the model's float32
    weights the file's values, as a GGUF load dequantizes them; then served from the file."""
    from tests.support.models import make_tiny_llama

    model = make_tiny_llama(0, VOCAB, hidden=256)
    rng = np.random.default_rng(6)
    cfg = model.config
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    wanted = [
        (f"blk.{i}.{short}.weight", getattr(getattr(layer, part), proj))
        for i, layer in enumerate(model.model.layers)
        for (part, proj), short in _FILE_NAMES.items()
    ] + [("output.weight", model.lm_head)]
    with torch.no_grad():
        for file_name, module in wanted:
            fmt = other if other and "ffn_down" in file_name else name
            n, k = module.weight.shape
            scale = 0.5 if file_name == "output.weight" else 0.05
            raw = _blocks(fmt, n, k, rng, scale) if fmt in FORMATS else None
            if raw is None:
                raw = quants.quantize(module.weight.numpy(), _kind(fmt))
            module.weight.copy_(_dequantized(fmt, raw))
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(file_name.split(".")[-2])
            writer.add_tensor(file_name, _permute(raw, heads) if heads else raw, raw_dtype=_kind(fmt))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf_blocks.attach(model, tmp_path / "model.gguf")
    return model


@pytest.fixture(params=FORMATS)
def gguf_llama(request, tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.delenv("RACER_KERNELS", raising=False)
    return _gguf_llama(tmp_path, request.param)


@needs_kernel
def test_a_rows_bits_equal_alone_in_a_tree_in_a_batch_and_on_one_thread(gguf_llama):
    model = gguf_llama
    assert sum(gguf_blocks.kept(model)["blocks"].values()) == 2 * 7 + 1
    q = model.model.layers[1].self_attn.q_proj
    assert torch.equal(q.racer_blocks.rows(torch.arange(q.weight.shape[0])), q.weight)  # the rows' order
    rng = random.Random(3)
    prompt = [rng.randrange(3, VOCAB) for _ in range(70)]
    tokens, parents = _tree(rng, 40)
    s = _session(model, prompt)
    assert s.backend.fused is not None and s.backend.cache.dtype == torch.float16  # as llama.cpp keeps it
    tree = _tree_hidden(s, tokens, parents)
    logits = s.backend.logits(tree)

    other = _session(model, [rng.randrange(3, VOCAB) for _ in range(11)])
    segs = [
        (b.backend, *b._inputs(tk, pa))
        for b, tk, pa in [(other, *_tree(rng, 7)), (_session(model, prompt), tokens, parents)]
    ]
    assert torch.equal(forward_segments(segs)[1], tree)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _session(model, prompt)
        assert torch.equal(_tree_hidden(one, tokens, parents), tree)
        assert torch.equal(one.backend.logits(tree), logits)
    finally:
        torch.set_num_threads(threads)
    for i in (0, 17, 39):
        alone = _session(model, prompt)
        for j in _path(parents, i):
            hidden = _step(alone, tokens[j])
        assert torch.equal(hidden, tree[i]), f"node {i} differs from its one-token step"
        assert torch.equal(alone.backend.logits(hidden[None])[0], logits[i])


@needs_kernel
def test_a_format_the_kernel_does_not_take_is_dequantized_with_a_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.delenv("RACER_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="verifier.gguf_blocks"):
        model = _gguf_llama(tmp_path, "Q4_1", other="BF16")
    assert any("BF16" in r.getMessage() and "dequantized" in r.getMessage() for r in caplog.records)
    assert gguf_blocks.kept(model)["dequantized"] == {"BF16": 2}
    assert not hasattr(model.model.layers[0].mlp.down_proj, "racer_blocks")
    rng = random.Random(8)
    prompt = [rng.randrange(3, VOCAB) for _ in range(20)]
    tokens, parents = _tree(rng, 12)
    s = _session(model, prompt)
    assert s.backend.fused is not None  # blocks and float32 weights side by side
    tree = _tree_hidden(s, tokens, parents)
    alone = _session(model, prompt)
    for j in _path(parents, 11):
        hidden = _step(alone, tokens[j])
    assert torch.equal(hidden, tree[11])


# -- the bundled model, served from its GGUF file -----------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    from verifier.model import load

    mp = pytest.MonkeyPatch()
    mp.delenv("RACER_KERNELS", raising=False)
    loaded = load("default", dtype="gguf")
    assert gguf_blocks.kept(loaded.model)["blocks"] == {"Q4_1": 210, "Q8_0": 1}
    yield loaded
    mp.undo()


@needs_kernel
@pytest.mark.slow
def test_the_bundled_models_blocks_hold_the_values_hugging_face_dequantizes(bundled):
    """Every projection's blocks, q and k rows put back in the model's order, are the file's values as
    the float32 model holds them; so is the output layer (the Q8_0 embedding, tied)."""
    m = bundled.model
    for layer in (m.model.layers[0], m.model.layers[-1]):
        attn = layer.self_attn
        for mod in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.up_proj):
            n = mod.weight.shape[0]
            assert torch.equal(mod.racer_blocks.rows(torch.arange(n)), mod.weight)
    ids = torch.arange(0, m.config.vocab_size, 97)
    assert torch.equal(m.lm_head.racer_blocks.rows(ids), m.lm_head.weight[ids])


def _generate(model, prompt: list[int], mode: str, budget: int, n: int) -> list[int]:
    from common.loop import generate
    from common.params import GenerationParams
    from drafter.draft_session import DraftSession
    from verifier.engine import VerifierSession

    v = VerifierSession(model, backend="llama")
    assert v.backend.fused is not None
    params = GenerationParams(max_new_tokens=n, mode=mode, budget=budget)
    return [t for c in generate(DraftSession(), v, prompt, params) for t in c]


@needs_kernel
@pytest.mark.slow
def test_the_bundled_model_in_every_mode_and_budget_equals_off(bundled):
    from common.params import MODES
    from common.text import DEFAULT_SYSTEM, chat_ids

    prompt = chat_ids(bundled.tokenizer, "List the planets of the solar system in order.", DEFAULT_SYSTEM)
    off = _generate(bundled.model, prompt, "off", 1, 32)
    assert len(off) == 32 and len(set(off)) > 10
    for mode in MODES:
        for budget in (1, 64) if mode == "racer" else (16,):
            assert _generate(bundled.model, prompt, mode, budget, 32) == off, f"{mode} C={budget}"


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_the_generic_build_gives_this_builds_bits(tmp_path, name):
    """The C fallback (a CPU without AVX2: x86-64-v2) makes the same integers and the same float32
    steps as this CPU's vector code: its results equal the built library's bit for bit."""
    import ctypes
    import subprocess

    out = tmp_path / "generic.so"
    flags = [f if f != "-march=native" else "-march=x86-64-v2" for f in native.FLAGS]
    done = subprocess.run(
        [native._compiler(), *flags, str(native.QUANT_SOURCE), str(native.POOL_SOURCE), "-o", str(out)],
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lib = ctypes.CDLL(str(out))
    assert lib.racer_quant_isa() == -1
    rng = np.random.default_rng(9)
    n, k = 24, 512
    raw = _blocks(name, n, k, rng)
    x = torch.randn((5, k), generator=torch.Generator().manual_seed(10))
    y = torch.empty((5, n))
    w = np.ascontiguousarray(raw)
    args = (ctypes.c_int(int(_kind(name))), ctypes.c_void_p(x.data_ptr()), w.ctypes.data_as(ctypes.c_void_p))
    rc = lib.racer_quant(*args, None, ctypes.c_void_p(y.data_ptr()), ctypes.c_long(5), ctypes.c_long(n),
                         ctypes.c_long(k), ctypes.c_int(1))  # fmt: skip
    assert rc == 0
    assert torch.equal(y, _run(x, name, raw, n, k))


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())


@needs_kernel
@pytest.mark.parametrize(
    "march,isa,flag", [("-march=x86-64-v3 -mavxvnni", 1, "avx_vnni"), ("-march=icelake-server", 2, "avx512_vnni")]
)
def test_the_vnni_builds_compile_and_where_the_cpu_has_them_give_this_builds_bits(tmp_path, march, isa, flag):
    """The dpbusd paths (AVX-VNNI, AVX512-VNNI) are built for any CPU here; on a CPU that has the
    instructions they run, and their packed and row results equal this build's bit for bit."""
    import ctypes
    import subprocess

    out = tmp_path / "vnni.so"
    flags = [g for f in native.FLAGS for g in (march.split() if f == "-march=native" else [f])]
    done = subprocess.run(
        [native._compiler(), *flags, str(native.QUANT_SOURCE), str(native.POOL_SOURCE), "-o", str(out)],
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lib = ctypes.CDLL(str(out))
    assert lib.racer_quant_isa() == isa
    if flag not in _cpu_flags():
        return  # built, not runnable on this CPU
    rng = np.random.default_rng(11)
    n, k = 24, 512
    for name in ("Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        raw = _blocks(name, n, k, rng)
        kind, packed = _weight(name, raw, n, k, packed=True)
        x = torch.randn((5, k), generator=torch.Generator().manual_seed(12))
        y = torch.empty((5, n))
        ptr, long, one = ctypes.c_void_p, ctypes.c_long, ctypes.c_int(1)
        rc = lib.racer_quant_packed(ctypes.c_int(kind), ptr(x.data_ptr()), ptr(packed.data_ptr()), None,
                                    ptr(y.data_ptr()), long(5), long(n), long(k), one, one)  # fmt: skip
        assert rc == 0
        assert torch.equal(y, _run(x, name, raw, n, k, packed=True))


@needs_kernel
def test_served_blocks_keep_a_float16_cache_and_the_kv_memory_counts_its_bytes(tmp_path, monkeypatch, tiny_llama):
    """A model served from its blocks caches K and V in float16 (as llama.cpp does), and the
    verifier's KV memory counts a token at that size; a plain float32 model keeps a float32 cache."""
    from verifier.kv_memory import kv_bytes_per_token
    from verifier.sessions import Verifier

    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.delenv("RACER_KERNELS", raising=False)
    model = _gguf_llama(tmp_path, "Q8_0")
    for m, dtype in ((model, torch.float16), (tiny_llama, torch.float32)):
        assert gguf_blocks.cache_dtype(m) == dtype
        v = Verifier(m, kv_memory_bytes=1 << 24)
        try:
            assert v.kv_memory.per_token == kv_bytes_per_token(m.config, dtype.itemsize)
        finally:
            v.close()
    assert _session(model, [5, 6, 7]).backend.cache.dtype == torch.float16
