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
* ``invariant`` (reduced precision): every call runs over fixed chunks of ``rows`` rows (the last
  one padded), so each row is computed by the identical kernel call whatever else shares the
  forward. ``rows`` is chosen by measurement (the smallest worst-case slowdown over the tree sizes
  the verifier uses) and the choice is checked at tuning: a row must come out bit-identical at any
  position of its chunk, or a smaller chunk is taken (one row is invariant by construction).

Environment: ``RACER_KERNELS`` = ``auto`` (default: cached choice or tune), ``tune`` (tune again),
or a kernel name, optionally with chunk rows (``linear``, ``linear:4``), which skips tuning (tests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # row counts timed; a call of n rows uses the smallest bucket >= n
_TUNE_SECONDS = 30.0  # soft bound on the whole tuning (few reps, interleaved, medians)
_SLOW_CALL_S = 0.1  # a candidate's call slower than this is not timed at larger buckets
_VERSION = 1


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


CANDIDATES = {"linear": _linear, "wxt": _wxt, "dup": _dup}
if _ONEDNN is not None:
    CANDIDATES["onednn"] = _onednn


def _usable(name: str, device: torch.device) -> bool:
    return device.type == "cpu" or name == "linear"


# -- plans -----------------------------------------------------------------------------------------


@dataclass
class ShapePlan:
    """How one weight shape's projections run."""

    by_bucket: dict[int, str] = field(default_factory=dict)  # fastest: bucket -> kernel
    kernel: str = "linear"  # invariant: the kernel of every chunk
    rows: int = 0  # invariant: rows per chunk (0: fastest plan)
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
            return chunked(fn, x, w, b, rows)
        n = x.shape[0]
        for bucket, fn in entry:
            if n <= bucket:
                return fn(x, w, b)
        return entry[-1][1](x, w, b)

    def describe(self) -> str:
        parts = []
        for (o, i), sp in self.shapes.items():
            if self.invariant:
                parts.append(f"{o}x{i}: {sp.kernel} x{sp.rows} rows")
            else:
                runs, prev = [], None
                for bucket in sorted(sp.by_bucket):
                    if prev and prev[1] == sp.by_bucket[bucket]:
                        prev[0] = f"{prev[0].split('-')[0]}-{bucket}"
                    else:
                        prev = [str(bucket), sp.by_bucket[bucket]]
                        runs.append(prev)
                parts.append(f"{o}x{i}: " + " ".join(f"{r}:{k}" for r, k in runs))
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
    }


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
    """Median seconds per (name, rows), the candidates interleaved within each repetition."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            x = inputs[k[1]]
            t0 = time.perf_counter()
            fn(x)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def tune_shape(
    w: torch.Tensor, buckets=BUCKETS, invariant: bool = False, reps: int = 5, candidates: dict | None = None
) -> ShapePlan:
    cands = {n: f for n, f in (candidates or CANDIDATES).items() if _usable(n, w.device)}
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {m: torch.randn((m, w.shape[1]), generator=gen).to(w.dtype).to(w.device) for m in buckets}
    fns, slow = {}, {}
    for name, fn in cands.items():
        for m in buckets:
            if name == "dup" and m != 1:
                continue  # the same as wxt beyond one row
            if name in slow:  # bounded tuning: a candidate this slow is extrapolated, not timed, beyond
                continue
            try:
                t0 = time.perf_counter()
                ok = _agrees(fn(inputs[m], w, None), F.linear(inputs[m], w))
                if time.perf_counter() - t0 > _SLOW_CALL_S:
                    slow[name] = m
            except RuntimeError:  # e.g. oneDNN without a kernel for this dtype on this CPU
                ok = False
            if ok:
                fns[(name, m)] = lambda x, fn=fn: fn(x, w, None)
    _time(fns, inputs, 1)  # warm-up: primitive creation, first-touch allocations
    first = max(_time({k: fns[k] for k in fns if k[1] == max(b for _, b in fns)}, inputs, 1).values(), default=0.0)
    if first * len(fns) * reps > _TUNE_SECONDS / 4:
        reps = 3
    elif first < 2e-3:  # cheap calls: more repetitions against a noisy machine, still milliseconds
        reps = 3 * reps
    ms = {k: v * 1e3 for k, v in _time(fns, inputs, reps).items()}
    for name, last in slow.items():  # linear in the rows beyond the last one timed (a lower bound, in practice)
        if (name, last) in ms:
            for m in buckets:
                if m > last:
                    ms[(name, m)] = ms[(name, last)] * m / last
    best = {m: min(((v, k[0]) for k, v in ms.items() if k[1] == m), default=(math.inf, "linear")) for m in buckets}
    plan = ShapePlan(ms={f"{k[0]}@{k[1]}": round(v, 4) for k, v in ms.items()})
    if not invariant:
        plan.by_bucket = {m: best[m][1] for m in buckets}
        return plan

    # Fixed chunks: the chunk size whose worst slowdown over the tree sizes is smallest, checked to be
    # position invariant (else the next; one row always is).
    def cost(n, r):
        return math.ceil(n / r) * best[r][0]

    regret = {r: max(cost(n, r) / min(cost(n, q) for q in buckets) for n in buckets) for r in buckets}
    for r in sorted(buckets, key=lambda r: (regret[r], r)):
        if r == 1 or position_invariant(cands[best[r][1]], w, r):
            plan.kernel, plan.rows = best[r][1], r
            return plan
    raise AssertionError("unreachable: one-row chunks are invariant")


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
    name, _, rows = spec.partition(":")
    if name not in CANDIDATES:
        raise ValueError(f"RACER_KERNELS={spec!r}: unknown kernel (one of {', '.join(CANDIDATES)}, auto, tune)")
    r = int(rows) if rows else 1
    shapes = {
        s: ShapePlan(by_bucket={b: name for b in BUCKETS}, kernel=name, rows=r if invariant else 0) for s in weights
    }
    return Plan(shapes, invariant, "forced")


def plan_for(model, invariant: bool | None = None, spec: str | None = None, cache: bool = True) -> Plan:
    """The model's kernel plan: forced by ``RACER_KERNELS``, read from the cache, or tuned now (and
    cached). Kept on the model, so every session of it shares one plan. ``invariant`` defaults to
    True for reduced precision."""
    weights = projection_weights(model)
    w0 = next(iter(weights.values()))
    dtype, device = w0.dtype, w0.device
    if invariant is None:
        invariant = dtype != torch.float32
    spec = spec if spec is not None else os.environ.get("RACER_KERNELS", "auto")
    held = getattr(model, "_racer_kernels", None)
    if held is not None and held[0] == (spec, invariant, torch.get_num_threads()):
        return held[1]
    if spec not in ("auto", "tune", ""):
        plan = _forced(spec, weights, invariant)
    else:
        plan = _tuned(model, weights, dtype, device, invariant, use_cache=cache and spec != "tune")
    model._racer_kernels = ((spec, invariant, torch.get_num_threads()), plan)
    return plan


def _tuned(model, weights, dtype, device, invariant, use_cache: bool) -> Plan:
    from .model import cache_root

    threads = torch.get_num_threads()
    ident, digest = _key(model, weights, dtype, threads, device, invariant)
    path = cache_root() / "kernels" / f"{digest}.json"
    if use_cache and path.exists():
        try:
            data = json.loads(path.read_text())
            shapes = {
                tuple(int(v) for v in s.split("x")): ShapePlan(
                    by_bucket={int(b): k for b, k in p["by_bucket"].items()},
                    kernel=p["kernel"],
                    rows=p["rows"],
                    ms=p["ms"],
                )
                for s, p in data["shapes"].items()
            }
            if set(shapes) == set(weights) and all(
                k in CANDIDATES for p in shapes.values() for k in [p.kernel, *p.by_bucket.values()]
            ):
                return Plan(shapes, invariant, "cache")
        except (OSError, ValueError, KeyError, TypeError):
            pass
    t0 = time.perf_counter()
    with torch.inference_mode():
        shapes = {s: tune_shape(w, invariant=invariant) for s, w in weights.items()}
    plan = Plan(shapes, invariant, "tuned")
    log.info("kernels tuned in %.1f s: %s", time.perf_counter() - t0, plan.describe())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(
            json.dumps(
                {
                    "key": ident,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "shapes": {
                        f"{o}x{i}": {"by_bucket": p.by_bucket, "kernel": p.kernel, "rows": p.rows, "ms": p.ms}
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
