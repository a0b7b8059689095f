"""The native projection kernels (verifier/native_linear.c): built here, equal to F.linear for every
row count and tail (float32 within float32 rounding; bfloat16 and float16 weights within one
rounding of the result), a row's bits independent of the other rows and of the thread count, and
offered only where they can run."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from verifier import kernels, machine, native, tuning

SHAPES = [(96, 64), (37, 19), (1536, 576), (576, 1536), (13, 40)]  # tails: rows % tile, K % vector


def _variants(dtype=torch.float32) -> list[str]:
    return [name for name in native.VARIANTS if native.usable(name) and dtype in native.dtypes(name)]


def _built() -> None:
    """Skips, saying why, where there is no C compiler to build the kernels; where there is one the
    library must build (a broken build fails, never skips)."""
    if native._compiler() is None:
        pytest.skip(f"native kernels not built: no C compiler (CC={os.environ.get('CC') or 'cc'} not found)")
    assert native.library() is not None, native.why()


def _built_variants(dtype=torch.float32) -> list[str]:
    """The variants to test: never an empty list that a loop would pass over."""
    _built()
    names = _variants(dtype)
    assert names, f"the library is built but no variant takes {dtype} on this CPU"
    return names


def test_the_library_is_built_here_with_tiles_for_this_vector_width():
    _built()
    bits = native.library().racer_vector_bits()
    assert bits in (256, 512)
    assert _variants() == [n for n, (_, b) in native.VARIANTS.items() if b == bits and n not in native.PAIRS]
    assert len(_variants()) == 2
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert all(kernels.usable(n, cpu, dtype) for n in _variants())
    # bfloat16 pairs multiplied natively: only where the compiler and the CPU have AVX512-BF16
    pairs = bool(native.library().racer_bf16_pairs())
    assert pairs == (bits == 512 and "avx512_bf16" in machine.fingerprint()["flags"])
    assert all(kernels.usable(n, cpu, torch.bfloat16) == pairs for n in native.PAIRS)
    assert not any(kernels.usable(n, cpu, d) for n in native.PAIRS for d in (torch.float32, torch.float16))


def test_every_variant_equals_linear_for_every_shape_and_row_count():
    names = _built_variants()
    gen = torch.Generator().manual_seed(0)
    for out, inp in SHAPES:
        w = torch.randn((out, inp), generator=gen) / inp**0.5
        b = torch.randn(out, generator=gen)
        for n in (*kernels.BUCKETS, 3, 5, 7, 13, 70):
            x = torch.randn((n, inp), generator=gen)
            for name in names:
                for bias in (None, b):
                    y = kernels.CANDIDATES[name](x, w, bias)
                    assert y.shape == (n, out) and y.is_contiguous()
                    msg = f"{name} {out}x{inp} x {n} rows, bias {bias is not None}"
                    torch.testing.assert_close(y, F.linear(x, w, bias), atol=1e-5, rtol=1e-5, msg=msg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_width_weights_equal_a_float32_product_within_one_rounding(dtype):
    gen = torch.Generator().manual_seed(2)
    names = _built_variants(dtype)
    for out, inp in SHAPES:
        w = (torch.randn((out, inp), generator=gen) / inp**0.5).to(dtype)
        b = torch.randn(out, generator=gen).to(dtype)
        for n in (1, 2, 4, 7, 16, 64):
            x = torch.randn((n, inp), generator=gen).to(dtype)
            ref = F.linear(x.float(), w.float(), b.float())  # the exact products, summed in float32
            for name in names:
                y = kernels.CANDIDATES[name](x, w, b)
                assert y.dtype == dtype and y.shape == (n, out) and y.is_contiguous()
                # one rounding of the float32 result to the half type: half an ulp, plus float32 sums
                ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
                assert ((y.float() - ref).abs() <= ref.abs() * ulp + 1e-4).all(), f"{name} {dtype} {out}x{inp} {n}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_threads(dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn((1536, 576), generator=gen).to(dtype)
    x = torch.randn((64, 576), generator=gen).to(dtype)
    threads = torch.get_num_threads()
    for name in _built_variants(dtype):
        fn = kernels.CANDIDATES[name]
        try:
            torch.set_num_threads(2)
            full = fn(x, w, None)
            torch.set_num_threads(1)
            assert torch.equal(fn(x, w, None), full), name
        finally:
            torch.set_num_threads(threads)
        for r in (0, 1, 5, 31, 63):
            assert torch.equal(fn(x[r : r + 1], w, None)[0], full[r]), (name, r)
            assert torch.equal(fn(x[r : r + 7], w, None)[0], full[r]), (name, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rows_bits_do_not_depend_on_the_row_blocks_or_the_widened_weight(dtype):
    # 1539 columns: a tail past the last vector, and few enough rows of x per L2 block that 150 rows
    # take several blocks; 200 weight rows: a tail past the last tile. A half-width weight tile is
    # widened once for a call of more rows than a tile's pass and read as it is for fewer.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn((200, 1539), generator=gen).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype)
    x = torch.randn((150, 1539), generator=gen).to(dtype)
    for name in _built_variants(dtype):
        fn = kernels.CANDIDATES[name]
        full = fn(x, w, b)
        torch.testing.assert_close(full.float(), F.linear(x.float(), w.float(), b.float()), atol=2e-1, rtol=2e-2)
        for r in (0, 2, 41, 97, 149):
            for rows in (1, 2, 5, 64):
                assert torch.equal(fn(x[r : r + rows], w, b)[0], full[r]), (name, r, rows)
            assert torch.equal(fn(x[: r + 1].flip(0).contiguous(), w, b)[0], full[r]), (name, r, "reversed")


def test_a_transposed_view_or_another_dtype_is_refused_not_misread():
    w = torch.randn(64, 32)
    x = torch.randn(4, 32)
    for name in _built_variants():
        for bad_w, bad_x in ((w.t().contiguous().t(), x), (w.bfloat16(), x), (w.half(), x.bfloat16())):
            try:
                kernels.CANDIDATES[name](bad_x, bad_w, None)
            except TypeError:
                continue
            raise AssertionError(f"{name} ran on a weight it cannot read")
    for name in native.PAIRS & set(_variants(torch.bfloat16)):
        with pytest.raises(TypeError):
            kernels.CANDIDATES[name](x, w, None)  # float32: the pairs kernels take bfloat16 only


def test_one_openmp_runtime_in_the_process():
    _built()  # without the library, only torch's runtime could be counted
    runtimes = native._openmp_runtimes()
    assert len(runtimes) == 1, runtimes


def test_the_off_switch_leaves_the_other_kernels(monkeypatch):
    name = _built_variants()[0]
    monkeypatch.setenv("RACER_NATIVE", "off")
    assert not native.usable(name) and not kernels.usable(name, torch.device("cpu"))
    monkeypatch.delenv("RACER_NATIVE")
    assert native.usable(name)


def test_a_missing_compiler_leaves_the_other_kernels(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_state", {})  # a fresh process whose compiler is missing
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native.library() is None and "no C compiler" in native.why()
    assert not any(kernels.usable(n, torch.device("cpu")) for n in native.VARIANTS)
    w = torch.randn(48, 32)
    plan = tuning.tune_shape(w, buckets=(1, 4), reps=1)
    assert not set(plan.by_bucket.values()) & set(native.VARIANTS)


def test_a_compiler_error_is_reported_not_raised(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake-cc 1.0 && exit 0\necho 'boom: no' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(fake))
    assert native.library() is None and "boom" in native.why()


def test_a_cache_it_cannot_write_builds_in_the_temporary_directory(monkeypatch, tmp_path):
    _built()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "native").write_text("a file where the directory would be")  # fails even for root
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("RACER_CACHE", str(cache))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path / "tmp"))
    lib = native.library()
    assert lib is not None, native.why()
    assert list((tmp_path / "tmp").glob("racer-native-*/linear-*.so"))


def test_a_rounds_calls_take_the_round_threads_and_a_prefills_every_thread(monkeypatch):
    monkeypatch.setattr(native, "_round", {"threads": 0})
    every = torch.get_num_threads()
    assert native.threads(1) == native.threads(10_000) == every
    native.round_threads(1)
    assert native.threads(1) == native.threads(native.ROUND_ROWS) == 1
    assert native.threads(native.ROUND_ROWS + 1) == every
    native.round_threads(every + 5)  # never more than torch's count
    assert native.threads(1) == every


def test_top_rows_are_torchs_top_k_values_with_ties_by_position_and_argmax_first():
    _built()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((16, 49_152), generator=gen)
    x[0, [9, 4, 700]] = x[0].max() + 1  # a three-way tie at the top: by position
    x[1, 17] = x[1, 3] = float("nan")  # NaN ranks above every number, the first one ahead
    x[2] = float("-inf")  # every token masked
    x[3, -5:] = x[3].max() + 1  # the best ones in the vector loop's scalar tail
    ids = native.top_rows(x, 8)
    assert ids.shape == (16, 8) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 0], torch.argmax(x, dim=-1))
    assert ids[0, :3].tolist() == [4, 9, 700] and ids[1, :2].tolist() == [3, 17] and ids[2].tolist() == list(range(8))
    finite = torch.ones(16, dtype=torch.bool)
    finite[1] = False
    assert torch.equal(x.gather(1, ids)[finite], torch.topk(x, 8, dim=-1).values[finite])
    for k in (1, 3, 100):
        assert torch.equal(native.top_rows(x, k)[:, : min(k, 8)], ids[:, : min(k, 8)])


def test_top_rows_of_a_row_do_not_depend_on_the_other_rows_or_the_threads():
    _built()
    x = torch.randn((40, 5_000), generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = native.top_rows(x, 8)
        torch.set_num_threads(1)
        assert torch.equal(native.top_rows(x, 8), full)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 7, 39):
        assert torch.equal(native.top_rows(x[r : r + 1], 8)[0], full[r])
    y = x.clone()
    y[7, int(full[7, 5])] += 10.0  # a changed row is caught: its sixth best moves to the top
    assert native.top_rows(y, 8)[7, 0] == full[7, 5] and torch.equal(native.top_rows(y, 8)[8], full[8])


def test_top_rows_refuse_what_they_do_not_take():
    _built()
    x = torch.randn((2, 50))
    assert native.top_rows(x.double(), 4) is None and native.top_rows(x[0], 4) is None
    assert native.top_rows(x, 0) is None and native.top_rows(x, 51) is None
    assert torch.equal(native.top_rows(x.t().contiguous().t(), 4), native.top_rows(x, 4))  # a strided view is copied


def test_a_lone_streams_round_takes_every_thread_on_its_own_thread_only(monkeypatch):
    monkeypatch.setattr(native, "_round", {"threads": 1})
    every = torch.get_num_threads()
    beside: list[int] = []
    with native.lone_stream():
        assert native.threads(1) == native.threads(native.ROUND_ROWS) == every
        t = threading.Thread(target=lambda: beside.append(native.threads(1)))  # e.g. the model thread
        t.start()
        t.join()
    assert beside == [1]
    assert native.threads(1) == 1
