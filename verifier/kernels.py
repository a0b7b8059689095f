"""Projection kernels chosen by measurement on the machine the verifier runs on.

A decoder's projections (and the output layer) are GEMMs of a few rows against a fixed weight. Which
implementation of ``x @ W.T`` is fastest for 1, 4 or 64 rows depends on the CPU, the BLAS build,
the dtype and the thread count: a ``W @ x.T`` variant tuned on one machine lost 2.7x to plain
``F.linear`` on another. So nothing here is assumed: at model load every candidate is timed on the
model's own weights for each row bucket the verifier uses (1 up to the largest tree x batch),
checked against ``F.linear``, and the fastest is kept. ``F.linear`` is always a candidate, so the
choice is never slower than it, as measured. The choice is cached per (machine, model, dtype,
threads) under ``cache_root()/kernels``.

Two kinds of plan:

* ``fastest`` (float32): per row bucket the fastest kernel; a row's bits may depend on how many
  rows share the call (MKL's float32 GEMM is not batch invariant), which float32 does not need:
  its contract is token identity with Hugging Face greedy decoding.
* ``invariant`` (reduced precision): a shape runs either a row-invariant kernel unchunked (the
  native ones: each output the same float32 operations in a fixed order, whatever the other rows,
  so a one-token step computes one row) or another kernel over fixed chunks of ``rows`` rows (the
  last one padded), so each row is computed by the identical kernel call whatever else shares the
  forward. The option is chosen by measurement (the smallest sum of slowdowns against the best
  option at each tree size the verifier uses) and a chunked choice is checked at tuning: a row must
  come out bit-identical at any position of its chunk, or the next option is taken (one row is
  invariant by construction).

Candidates come from two BLAS libraries, torch's (MKL, and oneDNN) and numpy's OpenBLAS, whose
float32 GEMM with few rows streams the weight faster on some CPUs and slower on others, and from
``native_linear.c`` (``verifier/native.py``): float32 kernels compiled for this CPU that stream each
weight row once per call instead of packing the weight, in a few tile shapes. In float32 a
shape's weight may also be *stored transposed* (``layout`` ``col``: the same values, the module's
``weight`` a transposed view of contiguous ``[in, out]`` storage, so no memory is added and any
other reader of the module sees the same tensor): ``x @ W.T`` is then a plain NN GEMM, which some
BLAS builds run faster than the transposed product. Both layouts are timed, and a shape's layout is
the one whose per-bucket best times lose least to the other's.

Environment: ``RACER_KERNELS`` = ``auto`` (default: cached choice or tune), ``tune`` (tune again),
or a kernel name, optionally with chunk rows and a layout (``linear``, ``linear:4``, ``blas@col``),
which skips tuning (tests).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import arena, native

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # row counts timed; a call of n rows uses the smallest bucket >= n
_TUNE_SECONDS = 30.0  # soft bound on the whole tuning (few reps, interleaved, medians)
_SLOW_CALL_S = 0.1  # a candidate's call slower than this is not timed at larger buckets
_VERSION = 5  # 3: native kernels, choices checked over a whole forward; 4: measured on packed weights;
# 5: numpy's BLAS held to one thread in a symlinked environment too (choices measured with it spinning)
LAYOUTS = ("row", "col")  # a weight stored as is ([out, in] rows), or transposed ([in, out] storage)


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


def _usable(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    if name.startswith("blas"):  # numpy: CPU float32 only (it has no bfloat16)
        return device.type == "cpu" and dtype == torch.float32
    if name in native.VARIANTS:  # built for this CPU at first use; float32, bfloat16 or float16 weights
        return device.type == "cpu" and dtype in native.dtypes(name) and native.usable(name, _cpu_identity())
    return device.type == "cpu" or name == "linear"


def row_invariant(name: str) -> bool:
    """Kernels whose row results never depend on the other rows of the call, by construction (each
    output the same float32 operations in a fixed order): an invariant plan runs them unchunked."""
    return name in native.VARIANTS


def _row_only(name: str) -> bool:
    """Kernels that read the weight's rows in place (not a transposed view)."""
    return name in native.VARIANTS


def _transposable(w: torch.Tensor) -> bool:
    """Whether a weight may be stored transposed: float32 on a CPU (the layouts were measured there;
    reduced precision keeps its rows for the invariant chunks)."""
    return w.device.type == "cpu" and w.dtype == torch.float32


def stored_as(w: torch.Tensor) -> str:
    """``col`` when a 2-D weight is a transposed view of contiguous storage, else ``row``."""
    return "col" if arena.transposed(w) else "row"


def in_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """``w`` stored as ``layout``: itself when it already is, else a copy with the same values."""
    if stored_as(w) == layout:
        return w
    return w.t().contiguous().t() if layout == "col" else w.contiguous()


def set_layout(param: torch.Tensor, layout: str) -> None:
    """Stores a weight (in place: its ``data``, so tied modules follow) as ``layout``; same values. A
    packed weight (``verifier/arena.py``) is written back into its own slot."""
    if stored_as(param.data) != layout:
        value = in_layout(param.data, layout)
        flat = arena.slot(param)
        if flat is None:
            param.data = value
        else:
            arena.place(param, flat, value)


# -- plans -----------------------------------------------------------------------------------------


@dataclass
class ShapePlan:
    """How one weight shape's projections run."""

    by_bucket: dict[int, str] = field(default_factory=dict)  # fastest: bucket -> kernel
    kernel: str = "linear"  # invariant: the kernel of every chunk
    rows: int = 0  # invariant: rows per chunk (0: unchunked, a row-invariant kernel; or a fastest plan)
    layout: str = "row"  # how the shape's weights are stored (see the module docstring)
    ms: dict = field(default_factory=dict)  # measured medians, for the record: "kernel@rows" -> ms


class Plan:
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
                stored = " (stored transposed)" if sp.layout == "col" else ""
                parts.append(f"{o}x{i}{stored}: " + " ".join(f"{r}:{k}" for r, k in runs))
        mode = "invariant chunks" if self.invariant else "fastest per row bucket"
        return f"kernels ({mode}, {self.source}): " + "; ".join(parts)


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


# -- identity of what a choice holds for ---------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cpu_identity() -> str:
    fp = machine_fingerprint()
    return f"{fp['cpu']} {' '.join(fp['flags'])}"


def machine_fingerprint() -> dict:
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and model == (platform.processor() or platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = sorted(f for f in have if f.startswith(("avx", "amx", "fma", "f16c")))
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "flags": flags,
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "numpy": np.__version__,
        "blas": [f"{lib.internal_api} {lib.version} {getattr(lib, 'architecture', '')}" for lib in _numpy_blas()],
    }


def _numpy_blas() -> list:
    """threadpoolctl's controllers of the BLAS library numpy itself loaded (OpenBLAS in numpy's
    wheels), not of any other BLAS in the process (torch's own, where a build links one)."""
    from threadpoolctl import ThreadpoolController

    # numpy's wheels keep it in numpy.libs/ or numpy/.dylibs/. Real paths: through a symlinked
    # environment numpy's module path and the loaded library's path name different directories.
    home = os.path.realpath(os.path.dirname(np.__file__))
    return [
        lib
        for lib in ThreadpoolController().lib_controllers
        if lib.user_api == "blas" and os.path.realpath(lib.filepath).startswith(home)
    ]


def single_thread_blas() -> None:
    """numpy's BLAS runs on the calling thread alone, whatever torch's thread count: its own thread
    pool beside torch's OpenMP one makes the two spin against each other for the cores (measured on
    2 cores: a one-token step went from 57 to 269 ms). So its candidates are timed, and run, as
    one-thread GEMMs, and win only where one thread of OpenBLAS beats all of torch's."""
    for lib in _numpy_blas():
        lib.set_num_threads(1)


@contextmanager
def loaded_layout(model):
    """For the block, every weight of ``model`` stored as Hugging Face loaded it (rows), then as the
    plan stored it again: Hugging Face's own forward then calls the GEMMs its users' runs call (the
    HF baselines of ``racer bench``). One weight's copy at a time, never a second model; not while a
    forward of the lean backend runs."""
    changed = [p for p in model.parameters() if stored_as(p) == "col"]
    with torch.inference_mode(False), torch.no_grad():
        for p in changed:
            set_layout(p, "row")
    try:
        yield model
    finally:
        with torch.inference_mode(False), torch.no_grad():
            for p in changed:
                set_layout(p, "col")


def projection_weights(model) -> dict[tuple[int, int], torch.Tensor]:
    """One weight per distinct projection shape of a Llama-family model (its first use)."""
    found: dict[tuple[int, int], torch.Tensor] = {}
    layer = model.model.layers[0]
    for mod in (
        layer.self_attn.q_proj,
        layer.self_attn.k_proj,
        layer.self_attn.v_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_proj,
        layer.mlp.up_proj,
        layer.mlp.down_proj,
        model.lm_head,
    ):
        found.setdefault(tuple(mod.weight.shape), mod.weight)
    return found


def all_projections(model) -> list[torch.nn.Parameter]:
    """Every projection weight of a Llama-family model and its output layer (tied ones once)."""
    params: dict[int, torch.nn.Parameter] = {}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for mod in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            params.setdefault(id(mod.weight), mod.weight)
    params.setdefault(id(model.lm_head.weight), model.lm_head.weight)
    return list(params.values())


def apply_layouts(model, plan: "Plan") -> None:
    """Stores every projection weight as its shape's plan says (in place; same values). Outside
    inference mode, whoever calls: the parameters must stay ordinary tensors. Parameters created in
    inference mode keep their storage (swapping an inference tensor's data leaves it unusable); every
    kernel computes the same values on either layout, only the speed differs."""
    with torch.inference_mode(False), torch.no_grad():
        for p in all_projections(model):
            if p.is_inference():
                continue
            sp = plan.shapes.get(tuple(p.shape))
            set_layout(p, sp.layout if sp is not None else "row")


def _key(model, weights, dtype, threads, device, invariant) -> tuple[dict, str]:
    cfg = model.config
    ident = {
        "version": _VERSION,
        "machine": machine_fingerprint() if device.type == "cpu" else {"cuda": torch.cuda.get_device_name(device)},
        "model": {
            "type": getattr(cfg, "model_type", ""),
            "layers": getattr(cfg, "num_hidden_layers", 0),
            "shapes": sorted(list(s) for s in weights),
        },
        "dtype": str(dtype).replace("torch.", ""),
        "threads": threads,
        "invariant": invariant,
        "buckets": list(BUCKETS),
        "native": [n for n in native.VARIANTS if _usable(n, device, dtype)],
        "native_source": native.source_digest(),
        "packed": arena.packed(model),
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return ident, digest


# -- tuning ----------------------------------------------------------------------------------------


def _agrees(y: torch.Tensor, ref: torch.Tensor) -> bool:
    if y.shape != ref.shape or not torch.isfinite(y).all():
        return False
    tol = 1e-4 if y.dtype == torch.float32 else 2e-2
    scale = ref.float().abs().max().item() + 1e-6
    return (y.float() - ref.float()).abs().max().item() <= tol * scale * math.sqrt(max(1, ref.shape[-1] / 64))


def _time(fns: dict, inputs: dict, reps: int) -> dict:
    """Median seconds per key (its last element: the rows), the candidates interleaved within each
    repetition."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            x = inputs[k[-1]]
            t0 = time.perf_counter()
            fn(x)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def tune_shape(
    w: torch.Tensor,
    buckets=BUCKETS,
    invariant: bool = False,
    reps: int = 5,
    candidates: dict | None = None,
    layouts: tuple[str, ...] | None = None,
) -> ShapePlan:
    """Times every usable candidate for every bucket (and, in float32, with the weight stored either
    way); ``layouts`` defaults to both in float32 and ``row`` otherwise (invariant plans keep rows)."""
    cands = {n: f for n, f in (candidates or CANDIDATES).items() if _usable(n, w.device, w.dtype)}
    if layouts is None:
        layouts = LAYOUTS if _transposable(w) and not invariant else ("row",)
    stored = {lay: in_layout(w, lay) for lay in layouts}
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {m: torch.randn((m, w.shape[1]), generator=gen).to(w.dtype).to(w.device) for m in buckets}
    refs = {m: F.linear(inputs[m], w) for m in buckets}
    fns, slow = {}, {}
    for lay, wl in stored.items():
        for name, fn in cands.items():
            for m in buckets:
                if name == "dup" and m != 1:
                    continue  # the same as wxt beyond one row
                if (name, lay) in slow:  # bounded tuning: a candidate this slow is extrapolated, not timed, beyond
                    continue
                try:
                    t0 = time.perf_counter()
                    ok = _agrees(fn(inputs[m], wl, None), refs[m])
                    if time.perf_counter() - t0 > _SLOW_CALL_S:
                        slow[(name, lay)] = m
                except (RuntimeError, TypeError):  # e.g. oneDNN without a kernel for this dtype on this CPU
                    ok = False
                if ok:
                    fns[(name, lay, m)] = lambda x, fn=fn, wl=wl: fn(x, wl, None)
    _time(fns, inputs, 1)  # warm-up: primitive creation, first-touch allocations
    top = max((k[2] for k in fns), default=0)
    first = max(_time({k: f for k, f in fns.items() if k[2] == top}, inputs, 1).values(), default=0.0)
    if first * len(fns) * reps > _TUNE_SECONDS / 4:
        reps = 3
    elif first < 2e-3:  # cheap calls: more repetitions against a noisy machine, still milliseconds
        reps = 3 * reps
    ms = {k: v * 1e3 for k, v in _time(fns, inputs, reps).items()}
    for (name, lay), last in slow.items():  # linear in the rows beyond the last one timed (a lower bound, in practice)
        if (name, lay, last) in ms:
            for m in buckets:
                if m > last:
                    ms[(name, lay, m)] = ms[(name, lay, last)] * m / last

    def best_of(lay):
        return {
            m: min(((v, k[0]) for k, v in ms.items() if k[1] == lay and k[2] == m), default=(math.inf, "linear"))
            for m in buckets
        }

    bests = {lay: best_of(lay) for lay in layouts}
    # The layout whose best per bucket loses least, summed over buckets, to the best of either layout
    # (a ratio, so one-row steps weigh as much as 64-node trees); ties keep the weight as it is.
    regret = {lay: sum(bests[lay][m][0] / min(bests[q][m][0] for q in layouts) for m in buckets) for lay in layouts}
    layout = min(layouts, key=lambda lay: (regret[lay], lay != stored_as(w)))
    best = bests[layout]
    plan = ShapePlan(
        layout=layout,
        ms={f"{k[0]}{'' if k[1] == 'row' else '/' + k[1]}@{k[2]}": round(v, 4) for k, v in ms.items()},
    )
    if not invariant:
        plan.by_bucket = {m: best[m][1] for m in buckets}
        return plan

    # Invariant options: fixed chunks of r rows (the fastest kernel at r, checked to be position
    # invariant, else the next option; one row always is), or a row-invariant kernel unchunked. Kept:
    # the option whose slowdowns against the best option at each tree size sum least (a ratio, so a
    # one-token step weighs as much as a 64-node tree: a kernel that reads half-width weights once
    # can win the small trees by more than it loses the large ones).
    def cost(n, r):
        return math.ceil(n / r) * best[r][0]

    options = {("chunks", r, best[r][1]): [cost(n, r) for n in buckets] for r in buckets}
    for name in cands:
        if row_invariant(name) and all((name, "row", n) in ms for n in buckets):
            options[("whole", 0, name)] = [ms[(name, "row", n)] for n in buckets]
    low = [min(costs[i] for costs in options.values()) for i in range(len(buckets))]
    slowdown = {opt: sum(c / lo for c, lo in zip(costs, low)) for opt, costs in options.items()}
    for how, r, name in sorted(options, key=lambda o: (slowdown[o], o[1])):
        if how == "whole" or r == 1 or position_invariant(cands[name], w, r):
            plan.kernel, plan.rows = name, r
            return plan
    raise AssertionError("unreachable: one-row chunks are invariant")


def _best_in(sp: ShapePlan, layout: str, m: int) -> str | None:
    """The fastest kernel of a shape's own timings at ``m`` rows with its weight stored as ``layout``."""
    tag = "" if layout == "row" else "/" + layout
    times = {k[: -len(f"{tag}@{m}")]: v for k, v in sp.ms.items() if k.endswith(f"{tag}@{m}") and ":" not in k}
    times = {k: v for k, v in times.items() if "/" not in k}
    return min(times, key=times.__getitem__) if times else None


def _fits(sp: ShapePlan, kernel: str, layout: str, m: int) -> bool:
    """Whether a uniform option may run ``kernel`` on this shape: it can read the layout, and the
    shape's own timing (where there is one) was not far off its best (some kernels are pathological
    on one layout: ``W @ x.T`` over a transposed output layer takes seconds)."""
    if layout == "col" and _row_only(kernel):
        return False
    tag = "" if layout == "row" else "/" + layout
    own = sp.ms.get(f"{kernel}{tag}@{m}")
    best = _best_in(sp, layout, m)
    return own is None if best is None else own is not None and own <= 2 * sp.ms[f"{best}{tag}@{m}"]


def _forward_times(params, choices: dict[str, dict], m: int, reps: int, gen) -> dict[str, float]:
    """Median seconds of one forward's projections at ``m`` rows per option (shape -> kernel)."""
    w0 = params[0]
    xs = {d: torch.randn((m, d), generator=gen).to(w0.dtype).to(w0.device) for d in {p.shape[1] for p in params}}

    runs = {
        name: [(CANDIDATES[choice[tuple(p.shape)]], p, xs[p.shape[1]]) for p in params if tuple(p.shape) in choice]
        for name, choice in choices.items()
    }

    def forward(run):
        for fn, w, x in run:
            fn(x, w, None)

    fns = {(name, m): lambda _, run=run: forward(run) for name, run in runs.items()}
    _time(fns, {m: None}, 1)  # warm-up
    return {name: t for (name, _), t in _time(fns, {m: None}, reps).items()}


def compose(
    model, shapes: dict[tuple[int, int], ShapePlan], buckets=BUCKETS, reps: int = 2, relayout: bool = True
) -> dict[int, str]:
    """Checks the per-shape choices as a whole and keeps what a forward runs fastest.

    A shape tuned alone runs with its weight hot in the caches, while a forward streams every
    layer's weights from memory, where a kernel that reads a weight once gains over one that packs
    it. So for each bucket one forward's projections (every weight of the model in layer order) are
    timed with the per-shape choices and with each kernel that won anywhere, and ``F.linear``, run
    for every shape that can take it; the options are interleaved and the fastest one's kernels
    become the bucket's. With ``relayout`` this is done twice when some shape was stored transposed:
    with the layouts chosen per shape and with every weight as loaded (rows); the layouts whose
    bucket bests lose least to the other's, summed over buckets, are kept (and applied). Returns
    bucket -> the option kept (``per-shape`` or a kernel's name; ``rows:`` when all rows won)."""
    chosen = {s: sp.layout for s, sp in shapes.items()}
    configs = {"": chosen}
    if relayout and any(lay != "row" for lay in chosen.values()):
        configs["rows:"] = {s: "row" for s in shapes}
    kernels_won = {k for sp in shapes.values() for k in sp.by_bucket.values()} | {"linear"}
    kernels_won |= {k for sp in shapes.values() for lay in LAYOUTS for m in buckets if (k := _best_in(sp, lay, m))}
    gen = torch.Generator(device="cpu").manual_seed(2)
    results: dict[str, dict[int, tuple[float, str, dict]]] = {}
    for tag, layouts in configs.items():
        _store(model, layouts)
        params = [p.detach() for p in all_projections(model)]  # the weights as the forward reads them
        results[tag] = {}
        for m in buckets:
            per_shape = {
                s: (sp.by_bucket[m] if layouts[s] == sp.layout else None) or _best_in(sp, layouts[s], m) or "linear"
                for s, sp in shapes.items()
            }
            options: dict[str, dict] = {"per-shape": per_shape}
            for k in sorted(kernels_won):
                if not _usable(k, params[0].device, params[0].dtype):
                    continue
                uniform = {s: k if _fits(shapes[s], k, layouts[s], m) else per_shape[s] for s in shapes}
                if uniform not in options.values():
                    options[k] = uniform
            times = _forward_times(params, options, m, reps, gen) if len(options) > 1 else {"per-shape": 0.0}
            best = min(times, key=lambda name: (times[name], name != "per-shape"))
            results[tag][m] = (times[best], best, options[best])
    top = {m: min(r[m][0] for r in results.values()) for m in buckets}
    regret = {tag: sum(r[m][0] / top[m] if top[m] > 0 else 1.0 for m in buckets) for tag, r in results.items()}
    win = min(results, key=lambda tag: (regret[tag], tag != ""))
    _store(model, configs[win])
    kept = {}
    for m in buckets:
        t, best, choice = results[win][m]
        for s, sp in shapes.items():
            sp.layout = configs[win][s]
            sp.by_bucket[m] = choice[s]
            sp.ms[f"forward:{win}{best}@{m}"] = round(t * 1e3, 3)
        kept[m] = win + best
    return kept


def _store(model, layouts: dict[tuple[int, int], str]) -> None:
    """Every projection weight of ``model`` stored as its shape's entry says (rows if absent)."""
    apply_layouts(model, Plan({s: ShapePlan(layout=lay) for s, lay in layouts.items()}, True, "layouts"))


def position_invariant(fn, w: torch.Tensor, rows: int, trials: int = 2, positions: int = 6) -> bool:
    """Is a row's output bit-identical wherever it sits in a ``rows``-row call, whatever the others?
    (Sampled: ``positions`` rows per trial, each moved to another position among other rows.)"""
    gen = torch.Generator(device="cpu").manual_seed(1)
    for t in range(trials):
        x = torch.randn((rows, w.shape[1]), generator=gen).to(w.dtype).to(w.device)
        y = fn(x, w, None)
        picks = sorted({0, rows - 1, *torch.randint(rows, (positions,), generator=gen).tolist()})[:positions]
        for r in picks:
            other = torch.randn((rows, w.shape[1]), generator=gen).to(w.dtype).to(w.device)
            at = (r + 1 + t) % rows
            other[at] = x[r]
            if not torch.equal(fn(other, w, None)[at], y[r]):
                return False
    return True


def _forced(spec: str, weights, invariant: bool) -> Plan:
    kernel, _, layout = spec.partition("@")
    name, _, rows = kernel.partition(":")
    if name not in CANDIDATES or layout not in ("", *LAYOUTS) or (layout == "col" and (invariant or _row_only(name))):
        raise ValueError(
            f"RACER_KERNELS={spec!r}: unknown kernel (one of {', '.join(CANDIDATES)}, optionally :rows and "
            "@row or @col (float32 only; not for native kernels); or auto, tune)"
        )
    w0 = next(iter(weights.values()))
    if not _usable(name, w0.device, w0.dtype) or (layout == "col" and not _transposable(w0)):
        raise ValueError(f"RACER_KERNELS={spec!r}: not available for {w0.dtype} on {w0.device}")
    r = int(rows) if rows else (0 if row_invariant(name) else 1)  # a row-invariant kernel: unchunked
    if rows and r < 1:
        raise ValueError(f"RACER_KERNELS={spec!r}: chunk rows must be >= 1")
    shapes = {
        s: ShapePlan(
            by_bucket={b: name for b in BUCKETS}, kernel=name, rows=r if invariant else 0, layout=layout or "row"
        )
        for s in weights
    }
    return Plan(shapes, invariant, "forced")


def plan_for(
    model, invariant: bool | None = None, spec: str | None = None, cache: bool = True, held_ok: bool = False
) -> Plan:
    """The model's kernel plan: forced by ``RACER_KERNELS``, read from the cache, or tuned now (and
    cached). Kept on the model, so every session of it shares one plan. ``invariant`` defaults to
    True for reduced precision.

    ``held_ok`` (a backend opening a session): a plan the model holds for the same spec serves
    whatever the calling thread's thread count says. Measuring belongs to whoever loads the model
    (the verifier does it before serving); a session opened on an event loop must never tune there
    (30-60 s), and a thread's OpenMP count can be stale (an executor thread keeps the count it
    started with).

    The first plan of a model may store weights transposed; a later measured one (another thread
    count) keeps the layouts as they are and chooses kernels for them, since a forward may be
    reading the weights. Only a forced spec (tests, by hand) stores them anew."""
    weights = projection_weights(model)
    w0 = next(iter(weights.values()))
    dtype, device = w0.dtype, w0.device
    if invariant is None:
        invariant = dtype != torch.float32
    spec = spec if spec is not None else os.environ.get("RACER_KERNELS", "auto")
    held = getattr(model, "_racer_kernels", None)
    threads = torch.get_num_threads()
    if held is not None and (held[0] == (spec, invariant, threads) or (held_ok and held[0][:2] == (spec, invariant))):
        return held[1]
    if device.type == "cpu":
        single_thread_blas()
        arena.pack(model)  # before anything is measured: the weights as every forward will read them
    if spec not in ("auto", "tune", ""):
        plan = _forced(spec, weights, invariant)
    else:
        keep = {shape: stored_as(w) for shape, w in weights.items()} if held is not None else None
        plan = _tuned(model, weights, dtype, device, invariant, use_cache=cache and spec != "tune", keep=keep)
    apply_layouts(model, plan)
    model._racer_kernels = ((spec, invariant, threads), plan)
    return plan


def _read_cached(path, weights, invariant) -> dict | None:
    """The cached shape plans at ``path`` if they are whole and usable here, else None."""
    w0 = next(iter(weights.values()))
    try:
        data = json.loads(path.read_text())
        shapes = {
            tuple(int(v) for v in s.split("x")): ShapePlan(
                by_bucket={int(b): str(k) for b, k in p["by_bucket"].items()},
                kernel=str(p["kernel"]),
                rows=int(p["rows"]),
                ms=dict(p["ms"]),
                layout=str(p["layout"]),
            )
            for s, p in data["shapes"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    for p in shapes.values():
        kernels = [p.kernel] if invariant else list(p.by_bucket.values())
        if (
            p.layout not in LAYOUTS
            or (p.layout == "col" and (invariant or not _transposable(w0) or any(map(_row_only, kernels))))
            or not kernels
            or not all(k in CANDIDATES and _usable(k, w0.device, w0.dtype) for k in kernels)
            or (invariant and (p.rows < 0 or (p.rows == 0 and not row_invariant(p.kernel))))
        ):
            return None
    return shapes if set(shapes) == set(weights) else None


def _tuned(model, weights, dtype, device, invariant, use_cache: bool, keep: dict | None = None) -> Plan:
    """``keep``: the layout each shape must keep (a model already planned); a plan tuned under it is
    not cached, the cache holding what the machine measures best."""
    from .model import cache_root

    threads = torch.get_num_threads()
    ident, digest = _key(model, weights, dtype, threads, device, invariant)
    path = cache_root() / "kernels" / f"{digest}.json"
    if use_cache and path.exists():
        shapes = _read_cached(path, weights, invariant)
        if shapes is not None and (keep is None or all(p.layout == keep[s] for s, p in shapes.items())):
            return Plan(shapes, invariant, "cache")
    t0 = time.perf_counter()
    with torch.inference_mode():
        shapes = {
            s: tune_shape(w, invariant=invariant, layouts=None if keep is None else (keep[s],))
            for s, w in weights.items()
        }
        if not invariant:  # the choices checked as a whole (their layouts applied to the model)
            kept = compose(model, shapes, relayout=keep is None)
            log.info("kernels per bucket after a whole forward's projections: %s", kept)
    plan = Plan(shapes, invariant, "tuned")
    log.info("kernels tuned in %.1f s: %s", time.perf_counter() - t0, plan.describe())
    if keep is not None:
        return plan
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(
            json.dumps(
                {
                    "key": ident,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "shapes": {
                        f"{o}x{i}": {
                            "by_bucket": p.by_bucket,
                            "kernel": p.kernel,
                            "rows": p.rows,
                            "layout": p.layout,
                            "ms": p.ms,
                        }
                        for (o, i), p in shapes.items()
                    },
                },
                indent=1,
            )
        )
        tmp.replace(path)
    except OSError as e:
        log.warning("kernel choice not cached: %s", e)
    return plan


def auto_dtype(device: str | torch.device = "cpu") -> str:
    """``--dtype auto``: bfloat16 where the hardware multiplies it natively (CUDA, or a CPU with AMX or
    AVX512-BF16), float32 elsewhere (bfloat16 GEMMs are emulated, and far slower, without them)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return "bfloat16"
    cpu = torch.cpu
    native = any(getattr(cpu, f, lambda: False)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return "bfloat16" if native else "float32"
