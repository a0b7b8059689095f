"""The native kernels checked on the machine that runs them, once per process, before first use.

The library is built with ``-march=native`` for whatever CPU serves (verifier/native.py), so the code
that serves was compiled for that machine alone, by that machine's compiler: a vectorizer that turns
a loop into other arithmetic there (GCC 12 once made a signed-byte loop into AVX512-VNNI's
unsigned-by-signed products) would go unnoticed by tests run elsewhere. So every kernel the library
offers is run on a few random rows of each format and shape class it serves and compared:

* the block kernel (``native_quant.c``), rows as stored and packed (packed on AMX-INT8 tiles too,
  where the CPU has them: "amx quant ..."), embedding lookups and packing, with the reference build
  (``native.reference_build()``: the same C code for the architecture's baseline, vectorization
  off), bit for bit: every build makes the same integers and the same float32 steps;
* the float kernels (row tiles, panels, attention) with a float64 computation on the same values,
  within what float32 rounding allows: for a product over K terms, ``|y - y64| <= 2 K u sum|x w|``
  (u = 2^-24; the bound holds for any order of the sums, fused or not); attention within 1e-4 of the
  output's scale (3e-2 on AMX tiles, which round their operands to bfloat16);
* the top-k selection with torch's, ids exactly.

A sign error, a wrong offset or a lost term is far outside these bounds. A kernel that disagrees is
refused: ``native`` serves its calls from the reference build (block kernel) or leaves it out of the
candidates (the others); the native decoder takes its block products from the reference build
too, and is not used where a float kernel it calls was refused. The
verdicts are logged, reported in the verifier's ``Stats`` and counted in a metric. The whole check
takes a few tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

# GGML type numbers and block layouts: bytes a block, values a block, offsets of its float16 fields.
FORMATS = {
    "Q4_0": (2, 18, 32, (0,)),
    "Q4_1": (3, 20, 32, (0, 2)),
    "Q5_0": (6, 22, 32, (0,)),
    "Q5_1": (7, 24, 32, (0, 2)),
    "Q8_0": (8, 34, 32, (0,)),
    "Q4_K": (12, 144, 256, (0, 2)),
    "Q5_K": (13, 176, 256, (0, 2)),
    "Q6_K": (14, 210, 256, (208,)),
}
PACKABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
AMX_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # what the block kernel multiplies on AMX-INT8 tiles
PACKED = 256  # a packed weight's type number: its GGML number + PACKED (native_quant.c)
QUANT_SHAPE = (16, 512)  # weight rows (two packed groups), columns (two K-quant super-blocks)
QUANT_ROWS = (1, 3, 4, 19)  # x rows: one; a tail of the 4-row tile; one tile; past a 16-row pass
LINEAR_SHAPE = (37, 83)  # rows and columns with tails: rows % every tile, columns % every vector
LINEAR_ROWS = (1, 5, 13)
U = 2.0**-24


@dataclass(frozen=True)
class Verdict:
    kernel: str  # e.g. "quant Q8_0 packed", "linear native6x2 bfloat16", "attention vector float16"
    ok: bool
    detail: str  # what was compared; for a refusal, where it disagreed and by how much


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _blocks(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A random weight [n, k] of format ``fmt`` as a GGUF file stores it (uint8 [n, row bytes]):
    random values and small finite float16 scales."""
    _, size, values, scales = FORMATS[fmt]
    blocks = torch.randint(0, 256, (n * (k // values), size), generator=gen, dtype=torch.uint8)
    for off in scales:
        d = (torch.rand(blocks.shape[0], generator=gen) * 0.05 + 0.001).to(torch.float16)
        blocks[:, off : off + 2] = d.view(torch.uint8).view(-1, 2)
    return blocks.view(n, -1).contiguous()


def _quant(lib, kind: int, x: torch.Tensor, w: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.full((x.shape[0], n), float("nan"))
    args = (x.data_ptr(), w.data_ptr(), _ptr(bias), y.data_ptr(), x.shape[0], n, x.shape[1], 1)
    rc = lib.racer_quant_packed(kind, *args, 1) if kind > PACKED else lib.racer_quant(kind, *args)
    if rc:
        raise RuntimeError(f"type {kind} refused ({rc})")
    return y


def _lookup(lib, kind: int, w: torch.Tensor, k: int) -> torch.Tensor:
    ids = torch.tensor([0, 5, 7, 8, 15], dtype=torch.int64)
    out = torch.full((len(ids), k), float("nan"))
    if lib.racer_quant_rows(kind, w.data_ptr(), ids.data_ptr(), len(ids), k, out.data_ptr()):
        raise RuntimeError(f"lookup of type {kind} refused")
    return out


def _differs(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Where two results' bits differ (None: nowhere)."""
    same = (a == b) | (a.isnan() & b.isnan())
    if bool(same.all()):
        return None
    at = tuple(int(i) for i in (~same).nonzero()[0])
    return f"{int((~same).sum())} of {a.numel()} values differ, e.g. at {at}: {a[at].item()!r} vs {b[at].item()!r}"


def _check_quant(lib, ref, fmt: str, packed: bool, gen: torch.Generator) -> str | None:
    """Where the library's block kernel for ``fmt`` (packed or as stored) differs from the reference
    build's, bit for bit; None where it does not."""
    kind = FORMATS[fmt][0]
    n, k = QUANT_SHAPE
    w = _blocks(fmt, n, k, gen)
    if packed:
        size = lib.racer_quant_packed_size(kind, n, k)
        mine, theirs = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
        if lib.racer_quant_pack(kind, w.data_ptr(), n, k, mine.data_ptr()):
            return "packing refused"
        ref.racer_quant_pack(kind, w.data_ptr(), n, k, theirs.data_ptr())
        if not torch.equal(mine, theirs):
            return "packed bytes differ from the reference's"
        w, kind = theirs, kind + PACKED
    if why := _differs(_lookup(lib, kind, w, k), _lookup(ref, kind, w, k)):
        return f"lookup: {why}"
    bias = torch.randn(n, generator=gen)
    for m in QUANT_ROWS:
        x = torch.randn((m, k), generator=gen) * 3
        for b in (None, bias):
            if why := _differs(_quant(lib, kind, x, w, n, b), _quant(ref, kind, x, w, n, b)):
                return f"{m} rows{' with a bias' if b is not None else ''}: {why}"
    return None


def _check_quant_amx(lib, ref, fmt: str, gen: torch.Generator) -> str | None:
    """``_check_quant`` of a packed format with every call of two rows or more on AMX-INT8 tiles."""
    lib.racer_quant_amx_rows(1)
    try:
        return _check_quant(lib, ref, fmt, True, gen)
    finally:
        lib.racer_quant_amx_rows(0)


def _beyond_bound(y: torch.Tensor, x64: torch.Tensor, w64: torch.Tensor, slack: float = 2.0) -> str | None:
    """Where ``y`` (float32) is farther from x64 @ w64.T than float32 rounding allows."""
    exact = x64 @ w64.T
    bound = slack * x64.shape[1] * U * (x64.abs() @ w64.abs().T) + 1e-30
    err = (y.double() - exact).abs()
    bad = ~(err <= bound)  # NaN counts as bad
    if not bool(bad.any()):
        return None
    at = tuple(int(i) for i in bad.nonzero()[0])
    return f"{int(bad.sum())} of {y.numel()} outputs off, e.g. at {at}: {y[at].item():.6g} vs {exact[at].item():.6g}"


_WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _check_linear(lib, tile: tuple[int, int], dtype: torch.dtype, pairs: bool, gen) -> str | None:
    n, k = LINEAR_SHAPE
    w = torch.randn((n, k), generator=gen).to(dtype)
    for m in LINEAR_ROWS:
        x = torch.randn((m, k), generator=gen)
        if pairs:
            x = x.to(torch.bfloat16)
        y = torch.full((m, n), float("nan"))
        kind = 3 if pairs else _WEIGHT_TYPES[dtype]
        if lib.racer_linear(*tile, kind, x.data_ptr(), w.data_ptr(), None, y.data_ptr(), m, n, k, 1):
            return f"the {tile} tile is not built"
        if why := _beyond_bound(y, x.double(), w.double(), slack=4.0 if pairs else 2.0):
            return f"{m} rows: {why}"
    return None


def _check_panel(lib, width: int, dtype: torch.dtype, gen) -> str | None:
    n, k = 2 * width, LINEAR_SHAPE[1]
    w = torch.randn((n, k), generator=gen).to(dtype)
    p = w.reshape(n // width, width, k).transpose(1, 2).contiguous()  # panels, as verifier/layouts.py stores them
    for m in LINEAR_ROWS:
        x = torch.randn((m, k), generator=gen)
        y = torch.full((m, n), float("nan"))
        lib.racer_linear_panel(_WEIGHT_TYPES[dtype], x.data_ptr(), p.data_ptr(), None, y.data_ptr(), m, n, k, 1)
        if why := _beyond_bound(y, x.double(), w.double()):
            return f"{m} rows: {why}"
    return None


def _attention64(
    q: torch.Tensor, kv: torch.Tensor, counts: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    n, h, _ = q.shape
    group = h // kv.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    k64, v64 = kv[0].double(), kv[1].double()
    for r in range(n):
        c = int(counts[r])
        for head in range(h):
            keys, vals = k64[head // group, :c], v64[head // group, :c]
            s = (keys @ q[r, head].double()) * scale
            p = torch.softmax(s if softcap is None else torch.tanh(s / softcap) * softcap, dim=0)
            out[r, head] = p @ vals
    return out


def _check_attention(native, path: str, dtype: torch.dtype, block: int, gen) -> str | None:
    heads, kv_heads, dim = 4, 2, 64
    # within a block; across blocks, a chain of rows; the vector path's soft-capped scores (Gemma 2's),
    # a cap that bends every score
    cases = [(3, 1, None), (block + 5, 6, None)] + ([(block + 5, 6, 0.5)] if path == "vector" else [])
    for past, n, softcap in cases:
        kv = torch.randn((2, kv_heads, past + n, dim), generator=gen).to(dtype)
        q = torch.randn((n, heads, dim), generator=gen).to(dtype).float()
        counts = torch.arange(past + 1, past + n + 1, dtype=torch.long)
        tail = torch.zeros((n, 0), dtype=torch.long)
        out = native.attention(q, kv, counts, counts.clone(), tail, dim**-0.5, path, softcap=softcap)
        exact = _attention64(q.to(torch.bfloat16).float() if path == "amx" else q, kv, counts, dim**-0.5, softcap)
        err = float((out.double() - exact).abs().max())
        tol = (3e-2 if path == "amx" else 1e-4) * (1 + float(exact.abs().max()))
        if not err <= tol:
            capped = f", scores capped at {softcap}" if softcap else ""
            return f"{n} rows after {past}{capped}: off by {err:.3g} (allowed {tol:.3g})"
    return None


def _check_top(lib, gen) -> str | None:
    logits = torch.randn((5, 1000), generator=gen)
    ids = torch.empty((5, 8), dtype=torch.int64)
    if lib.racer_top_rows(logits.data_ptr(), 5, 1000, 8, ids.data_ptr(), 1):
        return "refused"
    want = torch.topk(logits, 8, dim=-1).indices
    return None if torch.equal(ids, want) else f"ids {ids[0].tolist()} where torch gives {want[0].tolist()}"


def _verdict(kernel: str, compared: str, check, *args) -> Verdict:
    try:
        why = check(*args)
    except Exception as e:  # a kernel that raises is as unusable as one that disagrees
        why = f"raised {type(e).__name__}: {e}"
    return Verdict(kernel, why is None, compared if why is None else why)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def run(native, lib: ctypes.CDLL, ref: ctypes.CDLL | None) -> tuple[list[Verdict], float]:
    """Every kernel ``lib`` offers, checked (``native``: the module, for its variants and the
    attention entry point); the verdicts and the seconds it took. Without a reference build the
    block kernel cannot be checked, and is refused."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(20261204)
    out = []
    for fmt in FORMATS:
        for packed in (False, True) if fmt in PACKABLE else (False,):
            name = f"quant {fmt}{' packed' if packed else ''}"
            if ref is None:
                out.append(Verdict(name, False, f"no reference build: {native.why_reference()}"))
            else:
                out.append(
                    _verdict(name, "bits equal to the reference build", _check_quant, lib, ref, fmt, packed, gen)
                )
    for fmt in AMX_FORMATS if lib.racer_quant_amx() else ():
        name = f"amx quant {fmt} packed"
        if ref is None:
            out.append(Verdict(name, False, f"no reference build: {native.why_reference()}"))
        else:
            out.append(_verdict(name, "bits equal to the reference build", _check_quant_amx, lib, ref, fmt, gen))
    bits, pairs = lib.racer_vector_bits(), bool(lib.racer_bf16_pairs())
    for name, (tile, width) in native.VARIANTS.items():
        if width != bits or (name in native.PAIRS and not pairs):
            continue
        for dtype in (torch.bfloat16,) if name in native.PAIRS else tuple(_WEIGHT_TYPES):
            is_pair = name in native.PAIRS
            kernel = f"linear {name} {_dtype(dtype)}"
            out.append(_verdict(kernel, "within float32 rounding", _check_linear, lib, tile, dtype, is_pair, gen))
    width = lib.racer_panel_width()
    for dtype in (torch.bfloat16, torch.float16) if width else ():
        out.append(_verdict(f"panel {_dtype(dtype)}", "within float32 rounding", _check_panel, lib, width, dtype, gen))
    block = lib.racer_attention_block()
    for dtype in _WEIGHT_TYPES:
        for path in native.attention_paths(dtype, 4, 2, 64, checked=False):
            kernel = f"attention {path} {_dtype(dtype)}"
            out.append(_verdict(kernel, "within rounding", _check_attention, native, path, dtype, block, gen))
    out.append(_verdict("top_rows", "torch.topk's ids", _check_top, lib, gen))
    return out, time.perf_counter() - t0
