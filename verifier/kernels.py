"""Projection kernels and the plan that runs them on every forward.

A decoder's projections (and the output layer) are GEMMs of a few rows against a fixed weight.
``CANDIDATES`` are the implementations of ``x @ W.T`` on offer; a ``KernelPlan`` holds, for each
weight shape of one model, which of them runs and how, and ``KernelPlan.mm`` is what the lean
backend calls for every projection. Which candidate is fastest for 1, 4 or 64 rows depends on the
CPU, the BLAS build, the dtype and the thread count (a ``W @ x.T`` variant tuned on one machine
lost 2.7x to plain ``F.linear`` on another), so plans are measured where the verifier runs
(``verifier/tuning.py``), never assumed; ``F.linear`` is always a candidate.

Two kinds of plan:

* ``fastest`` (float32): per row bucket the fastest kernel; a row's bits may depend on how many
  rows share the call (MKL's float32 GEMM is not batch invariant), which float32 does not need:
  its contract is token identity with Hugging Face greedy decoding.
* ``invariant`` (reduced precision): a shape runs either a row-invariant kernel unchunked (the
  native ones: each output the same float32 operations in a fixed order, whatever the other rows,
  so a one-token step computes one row) or another kernel over fixed chunks of ``rows`` rows (the
  last one padded), so each row is computed by the identical kernel call whatever else shares the
  forward.

Candidates come from two BLAS libraries, torch's (MKL, and oneDNN) and numpy's OpenBLAS, whose
float32 GEMM with few rows streams the weight faster on some CPUs and slower on others, and from
``native_linear.c`` (``verifier/native.py``): float32 kernels compiled for this CPU that stream each
weight row once per call instead of packing the weight, in a few tile shapes. In float32 a weight
may also be stored transposed (``verifier/layouts.py``), which some BLAS builds multiply faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import native
from .machine import cpu_identity

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # row counts timed; a call of n rows uses the smallest bucket >= n
LAYOUTS = ("row", "col", "panel")  # as is ([out, in] rows), transposed ([in, out] storage), or panels


# -- candidates ------------------------------------------------------------------------------------


def _linear(x, w, b):
    return F.linear(x, w, b)


def _wxt(x, w, b):
    """``W @ x.T`` with contiguous rows out (one tall GEMM instead of a wide one)."""
    y = (w @ x.contiguous().t()).t().contiguous()
    return y if b is None else y + b


def _dup(x, w, b):
    """One row computed as two (a two-column GEMM instead of a GEMV); more rows as ``_wxt``."""
    if x.shape[0] != 1:
        return _wxt(x, w, b)
    y = (w @ torch.cat((x, x)).t())[:, :1].t().contiguous()
    return y if b is None else y + b


_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _onednn(x, w, b):
    return _ONEDNN(x.contiguous(), w, b, "none", [], "")


def _blas(x, w, b):
    """numpy's OpenBLAS ``x @ W.T`` (no copy either way: numpy views of the tensors). On a weight
    stored transposed this is an NN GEMM over contiguous ``[in, out]`` storage."""
    y = torch.from_numpy(np.matmul(x.detach().numpy(), w.detach().numpy().T))
    return y if b is None else y + b


def _blas_wxt(x, w, b):
    """numpy's OpenBLAS ``W @ x.T``, contiguous rows out."""
    y = torch.from_numpy(np.ascontiguousarray(np.matmul(w.detach().numpy(), x.detach().numpy().T).T))
    return y if b is None else y + b


CANDIDATES = {"linear": _linear, "wxt": _wxt, "dup": _dup}
if _ONEDNN is not None:
    CANDIDATES["onednn"] = _onednn
CANDIDATES["blas"] = _blas
CANDIDATES["blas_wxt"] = _blas_wxt
CANDIDATES.update({name: native.linear(name) for name in native.VARIANTS})
CANDIDATES[native.PANEL] = native.linear_panel


def usable(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether candidate ``name`` runs on weights of ``dtype`` on ``device`` here."""
    if name.startswith("blas"):  # numpy: CPU float32 only (it has no bfloat16)
        return device.type == "cpu" and dtype == torch.float32
    if name in native.VARIANTS:  # built for this CPU at first use; float32, bfloat16 or float16 weights
        return device.type == "cpu" and dtype in native.dtypes(name) and native.usable(name, cpu_identity())
    if name == native.PANEL:  # reduced-precision weights stored as panels
        return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and native.panel_width() > 0
    return device.type == "cpu" or name == "linear"


def row_invariant(name: str) -> bool:
    """Kernels whose row results never depend on the other rows of the call, by construction (each
    output the same float32 operations in a fixed order): an invariant plan runs them unchunked."""
    return name in native.VARIANTS or name == native.PANEL


def reads(name: str) -> tuple[str, ...]:
    """The layouts a kernel reads a weight in: the native row tiles rows in place, the panel kernel
    panels, every other one rows or a transposed view."""
    if name == native.PANEL:
        return ("panel",)
    return ("row",) if name in native.VARIANTS else ("row", "col")


def row_only(name: str) -> bool:
    """Kernels that read the weight's rows in place (not a transposed view)."""
    return reads(name) == ("row",)


# -- plans -----------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Timing:
    """What one measured median of ``ShapePlan.ms`` is of."""

    kernel: str  # a candidate; for a whole forward, the option kept ("per-shape" or a candidate)
    layout: str  # how the weight was stored: "row" or "col"
    rows: int  # rows per call
    forward: bool = False  # a whole forward's projections (``tuning.compose``), not this shape alone


@dataclass
class ShapePlan:
    """How one weight shape's projections run."""

    by_bucket: dict[int, str] = field(default_factory=dict)  # fastest: bucket -> kernel
    kernel: str = "linear"  # invariant: the kernel of every chunk
    rows: int = 0  # invariant: rows per chunk (0: unchunked, a row-invariant kernel; or a fastest plan)
    layout: str = "row"  # how the shape's weights are stored (``verifier/layouts.py``)
    ms: dict[Timing, float] = field(default_factory=dict)  # measured medians, for the record


class KernelPlan:
    """Kernel choice for every projection shape of one model; ``mm(x, w, b)`` runs it."""

    def __init__(self, shapes: dict[tuple[int, int], ShapePlan], invariant: bool, source: str):
        self.shapes = shapes
        self.invariant = invariant
        self.source = source  # "tuned", "cache" or "forced"
        self._fns = {}
        for shape, sp in shapes.items():
            if invariant:
                self._fns[shape] = (CANDIDATES[sp.kernel], sp.rows)
            else:
                self._fns[shape] = [(b, CANDIDATES[sp.by_bucket[b]]) for b in sorted(sp.by_bucket)]

    def mm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x [n, in] -> [n, out] with the chosen kernel (contiguous rows out)."""
        entry = self._fns.get(tuple(w.shape))
        if entry is None:
            return F.linear(x, w, b)
        if self.invariant:
            fn, rows = entry
            return fn(x, w, b) if rows == 0 else chunked(fn, x, w, b, rows)
        n = x.shape[0]
        for bucket, fn in entry:
            if n <= bucket:
                return fn(x, w, b)
        return entry[-1][1](x, w, b)

    def describe(self) -> str:
        parts = []
        for (o, i), sp in self.shapes.items():
            if self.invariant:
                parts.append(f"{o}x{i}: {sp.kernel} " + (f"x{sp.rows} rows" if sp.rows else "unchunked"))
            else:
                runs, prev = [], None
                for bucket in sorted(sp.by_bucket):
                    if prev and prev[1] == sp.by_bucket[bucket]:
                        prev[0] = f"{prev[0].split('-')[0]}-{bucket}"
                    else:
                        prev = [str(bucket), sp.by_bucket[bucket]]
                        runs.append(prev)
                stored = {"col": " (stored transposed)", "panel": " (stored as panels)"}.get(sp.layout, "")
                parts.append(f"{o}x{i}{stored}: " + " ".join(f"{r}:{k}" for r, k in runs))
        mode = "invariant chunks" if self.invariant else "fastest per row bucket"
        return f"kernels ({mode}, {self.source}): " + "; ".join(parts)

    def layouts(self) -> dict[tuple[int, int], str]:
        """Shape -> how its weights are stored."""
        return {s: sp.layout for s, sp in self.shapes.items()}


def chunked(fn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``fn`` over fixed chunks of ``rows`` rows, the last one zero-padded: every row goes through the
    identical call shape, whatever else shares the forward."""
    n = x.shape[0]
    if n == rows:
        return fn(x, w, b)
    pad = -n % rows
    if pad:
        x = torch.cat((x, x.new_zeros((pad, x.shape[1]))))
    outs = [fn(x[s : s + rows], w, b) for s in range(0, n + pad, rows)]
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y[:n] if pad else y
