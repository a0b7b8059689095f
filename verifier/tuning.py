"""Choosing a model's kernel plan at start-up: by measurement on the machine the verifier runs on.

At model load every candidate of ``verifier/kernels.py`` is timed on the model's own weights for
each row bucket the verifier uses (1 up to the largest tree x batch; each bucket in its own round,
the candidates interleaved after a warm-up call: ``_time``), checked against ``F.linear``, and the
fastest is kept. ``F.linear`` is always a candidate, so the choice is never slower than it,
as measured. A float32 shape's weight is timed stored either way (``verifier/layouts.py``), and a
shape's layout is the one whose per-bucket best times lose least to the other's. The per-shape
choices are then checked over a whole forward's projections (``compose``). The choice is cached
per (machine, model, dtype, threads) by ``verifier/plan_cache.py``.

An invariant plan (reduced precision) keeps one option per shape for every row count (a row's bits
may not depend on how many rows share the call): among the options whose one-row call is within
``ONE_ROW_SLACK`` of the fastest one-row call (a decode step never pays for padding to a chunk),
the one with the smallest sum of slowdowns against the best option at each tree size the verifier
uses; a chunked choice is checked at tuning: a row must come out bit-identical at any position of
its chunk, or the next option is taken (one row is invariant by construction).

Environment: ``RACER_KERNELS`` = ``auto`` (default: cached choice or tune), ``tune`` (tune again),
or a kernel name, optionally with chunk rows and a layout (``linear``, ``linear:4``, ``blas@col``),
which skips tuning (tests).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from . import arena, kernels, native, plan_cache
from .gguf_blocks import kept
from .kernels import BUCKETS, CANDIDATES, LAYOUTS, KernelPlan, ShapePlan, Timing
from .layouts import (
    all_projections,
    apply_layouts,
    in_layout,
    panelable,
    projection_weights,
    stored_as,
    transposable,
)
from .machine import single_thread_blas

log = logging.getLogger(__name__)

TUNE_SECONDS = 30.0  # soft bound on the whole tuning (few reps, interleaved, medians)
SLOW_CALL_S = 0.1  # a candidate's call slower than this is not timed at larger buckets
ONE_ROW_SLACK = 1.1  # an invariant plan's one-row call may cost at most this much over the fastest one
ROUND_REPS = 5  # timed repetitions of one row count's round (``_time``)


def kernel_plan(
    model, invariant: bool | None = None, spec: str | None = None, cache: bool = True, held_ok: bool = False
) -> KernelPlan:
    """The model's kernel plan: forced by ``RACER_KERNELS``, read from the cache, or tuned now (and
    cached). Kept on the model, so every session of it shares one plan. ``invariant`` defaults to
    True for reduced precision.

    ``held_ok`` (a backend opening a session): a plan the model holds for the same spec serves
    whatever the calling thread's thread count says. Measuring belongs to whoever loads the model
    (the verifier does it before serving); a session opened on an event loop must never tune there
    (tens of seconds), and a thread's OpenMP count can be stale (an executor thread keeps the count it
    started with).

    The first plan of a model may store weights transposed; a later measured one (another thread
    count) keeps the layouts as they are and chooses kernels for them, since a forward may be
    reading the weights. Only a forced spec (tests, by hand) stores them anew."""
    weights = projection_weights(model)
    w0 = next(iter(weights.values()))
    blocks = kept(model) is not None  # GGUF blocks: invariant, float32 weights on a native row tile
    if invariant is None:
        invariant = w0.dtype != torch.float32 or blocks
    spec = spec if spec is not None else os.environ.get("RACER_KERNELS", "auto")
    stream = blocks and spec in ("auto", "tune", "")  # the block kernel's handout measured (not forced)
    if stream:
        spec = _block_model_tile(w0)
    held = getattr(model, "_racer_kernels", None)
    threads = torch.get_num_threads()
    if held is not None and (held[0] == (spec, invariant, threads) or (held_ok and held[0][:2] == (spec, invariant))):
        return held[1]
    if w0.device.type == "cpu":
        single_thread_blas()
        arena.pack(model)  # before anything is measured: the weights as every forward will read them
        if stream:
            block_stream_rows(model)
            block_amx_rows(model)
    if spec not in ("auto", "tune", ""):
        plan = forced(spec, weights, invariant)
    else:
        # weights created in inference mode cannot be stored anew (``layouts.apply_layouts``): an
        # invariant plan, which could store them as panels, keeps them as they are
        frozen = held is not None or (invariant and any(p.is_inference() for p in all_projections(model)))
        keep = {shape: stored_as(w) for shape, w in weights.items()} if frozen else None
        plan = _tuned(model, weights, invariant, use_cache=cache and spec != "tune", keep=keep)
    layouts = plan.layouts()
    apply_layouts(model, layouts)
    stray = {tuple(p.shape) for p in all_projections(model) if stored_as(p) != layouts[tuple(p.shape)]}
    if any("panel" in (layouts[s], stored_as(weights[s])) for s in stray):  # the values would be misread
        raise ValueError(f"RACER_KERNELS={spec!r}: the weights of {sorted(stray)} cannot be stored as the plan says")
    model._racer_kernels = ((spec, invariant, threads), plan)
    return plan


STREAM_ROWS = (1, 2, 4, 8, 16)  # row counts tried for the block kernel's long runs, in order


def block_stream_rows(model, reps: int = 6, clock=None) -> int:
    """Up to how many rows a call of the block kernel hands out its packed weight in long runs
    (``native.quant_stream_rows``), measured: for each row count of ``STREAM_ROWS`` in turn, a pass
    over every packed projection of the model with long runs and one with runs of 4, interleaved
    (``_time``), and the row count taken while long runs win by the medians. A call of few rows
    streams its weight from memory, where long contiguous runs are faster (on an AMD EPYC Zen 3, two
    threads, a one-token step 10% faster); a call of more rows computes more per byte, where short
    runs keep the threads even. The same values either way. Set for the process and returned; 0:
    every call by runs of 4."""
    blocks = _packed_blocks(model)
    chosen = 0
    gen = torch.Generator().manual_seed(0)
    for rows in STREAM_ROWS if blocks else ():
        xs = {k: torch.randn(rows, k, generator=gen) for k in {b.k for b in blocks}}
        fns = {
            ("long", rows): _every_block(blocks, native.quant_stream_rows, rows),
            ("short", rows): _every_block(blocks, native.quant_stream_rows, 0),
        }
        t = _time(fns, {rows: xs}, reps, clock)
        if t[("long", rows)] >= t[("short", rows)]:
            break
        chosen = rows
    native.quant_stream_rows(chosen)
    if blocks:
        log.info("block kernel: calls of at most %d rows hand out long runs", chosen)
    return chosen


AMX_ROWS = (2, 4, 8, 16)  # row counts tried for the block kernel's AMX-INT8 tiles, in order


def block_amx_rows(model, reps: int = 6, clock=None) -> int:
    """From how many rows a call of the block kernel multiplies on AMX-INT8 tiles
    (``native.quant_amx_rows``), measured where the CPU has them (``native.quant_amx``): for each row
    count of ``AMX_ROWS`` in turn, a pass over every packed projection of the model on tiles and one
    on vectors, interleaved, and the first count at which the tiles win by the medians taken (calls
    of more rows carry more work a tile). The same values either way. Set for the process and
    returned; 0: none (no AMX, or the tiles never won)."""
    blocks = _packed_blocks(model) if native.quant_amx() else []
    chosen = 0
    gen = torch.Generator().manual_seed(0)
    for rows in AMX_ROWS if blocks else ():
        xs = {k: torch.randn(rows, k, generator=gen) for k in {b.k for b in blocks}}
        fns = {
            ("tiles", rows): _every_block(blocks, native.quant_amx_rows, 1),
            ("vectors", rows): _every_block(blocks, native.quant_amx_rows, 0),
        }
        t = _time(fns, {rows: xs}, reps, clock)
        if t[("tiles", rows)] < t[("vectors", rows)]:
            chosen = rows
            break
    native.quant_amx_rows(chosen)
    if blocks:
        log.info("block kernel: calls of at least %d rows on AMX-INT8 tiles (0: none)", chosen)
    return chosen


def _packed_blocks(model) -> list:
    return [
        m.racer_blocks
        for m in model.modules()
        if getattr(m, "racer_blocks", None) is not None and m.racer_blocks.kind > native.PACKED
    ]


def _every_block(blocks: list, setting, value: int):
    """A pass over every packed projection of ``blocks``, with ``setting(value)`` before it is timed."""

    def run(xs):
        for b in blocks:
            b.matmul(xs[b.k])

    run.before = lambda: setting(value)
    return run


def _block_model_tile(w0: torch.Tensor) -> str:
    """The kernel of a model served from GGUF blocks for its float32 weights (the ones the block
    kernel does not take, and the op-by-op path): a native row tile, row invariant, that runs here;
    else the chunked torch kernel one row at a time."""
    for name in native.VARIANTS:
        if name not in native.PAIRS and kernels.usable(name, w0.device, w0.dtype):
            return name
    return "linear:1"


def forced(spec: str, weights, invariant: bool) -> KernelPlan:
    """The plan ``RACER_KERNELS=spec`` names (``kernel[:rows][@layout]``) for every shape; a kernel
    that reads one layout only defaults to it (``panel``: ``panel@panel``)."""
    kernel, _, layout = spec.partition("@")
    name, _, rows = kernel.partition(":")
    reads = kernels.reads(name) if name in CANDIDATES else ()
    if reads and not layout:
        layout = reads[0]
    if (
        name not in CANDIDATES
        or layout not in reads
        or (layout == "col" and invariant)
        or (layout == "panel" and not invariant)
    ):
        raise ValueError(
            f"RACER_KERNELS={spec!r}: unknown kernel (one of {', '.join(CANDIDATES)}, optionally :rows and "
            "@row, @col (float32 only; not for native row tiles) or @panel (the panel kernel, reduced "
            "precision); or auto, tune)"
        )
    w0 = next(iter(weights.values()))
    movable = {"col": transposable, "panel": panelable, "row": lambda w: True}[layout]
    if not kernels.usable(name, w0.device, w0.dtype) or not all(map(movable, weights.values())):
        raise ValueError(f"RACER_KERNELS={spec!r}: not available for {w0.dtype} on {w0.device}")
    r = int(rows) if rows else (0 if kernels.row_invariant(name) else 1)  # a row-invariant kernel: unchunked
    if rows and r < 1:
        raise ValueError(f"RACER_KERNELS={spec!r}: chunk rows must be >= 1")
    shapes = {
        s: ShapePlan(by_bucket={b: name for b in BUCKETS}, kernel=name, rows=r if invariant else 0, layout=layout)
        for s in weights
    }
    return KernelPlan(shapes, invariant, "forced")


def _tuned(model, weights, invariant, use_cache: bool, keep: dict | None = None) -> KernelPlan:
    """``keep``: the layout each shape must keep (a model already planned); a plan tuned under it is
    not cached, the cache holding what the machine measures best."""
    w0 = next(iter(weights.values()))
    ident, digest = plan_cache.key(model, weights, w0.dtype, torch.get_num_threads(), w0.device, invariant)
    path = plan_cache.path_of(digest)
    if use_cache and path.exists():
        shapes = plan_cache.read(path, weights, invariant)
        if shapes is not None and (keep is None or all(p.layout == keep[s] for s, p in shapes.items())):
            return KernelPlan(shapes, invariant, "cache")
    t0 = time.perf_counter()
    fixed = keep if keep is not None else _rows_only(model)
    with torch.inference_mode():
        shapes = {
            s: tune_shape(w, invariant=invariant, layouts=(fixed[s],) if s in fixed else None)
            for s, w in weights.items()
        }
        if not invariant:  # the choices checked as a whole (their layouts applied to the model)
            kept = compose(model, shapes, relayout=keep is None)
            log.info("kernels per bucket after a whole forward's projections: %s", kept)
    plan = KernelPlan(shapes, invariant, "tuned")
    log.info("kernels tuned in %.1f s: %s", time.perf_counter() - t0, plan.describe())
    if keep is None:
        plan_cache.write(path, ident, shapes, time.perf_counter() - t0)
    return plan


def _rows_only(model) -> dict[tuple[int, int], str]:
    """Shapes whose weights must keep their rows: an output layer tied to an embedding that is not
    a plain lookup (a scaled one, say), which could not read panels (``llama._embed``)."""
    emb, head = model.get_input_embeddings(), getattr(model, "lm_head", None)
    if head is None or emb is None or head.weight is not emb.weight or type(emb) is torch.nn.Embedding:
        return {}
    return {tuple(head.weight.shape): "row"}


# -- one shape -------------------------------------------------------------------------------------


def tune_shape(
    w: torch.Tensor,
    buckets=BUCKETS,
    invariant: bool = False,
    reps: int = 5,
    candidates: dict | None = None,
    layouts: tuple[str, ...] | None = None,
) -> ShapePlan:
    """Times every usable candidate for every bucket on each layout it reads; ``layouts`` defaults
    to rows and, in float32, the weight stored transposed, or in reduced precision stored as panels
    (where the weight's shape takes them)."""
    cands = {n: f for n, f in (candidates or CANDIDATES).items() if kernels.usable(n, w.device, w.dtype)}
    if layouts is None:
        layouts = default_layouts(w, invariant)
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {m: torch.randn((m, w.shape[1]), generator=gen).to(w.dtype).to(w.device) for m in buckets}
    fns, slow = _checked_calls(cands, w, {lay: in_layout(w, lay) for lay in layouts}, inputs, bare=invariant)
    ms = _measure(fns, inputs, reps)
    for (name, lay), last in slow.items():  # linear in the rows beyond the last one timed (a lower bound, in practice)
        if (name, lay, last) in ms:
            for m in buckets:
                if m > last:
                    ms[(name, lay, m)] = ms[(name, lay, last)] * m / last
    bests = {lay: _best_per_bucket(ms, lay, buckets) for lay in layouts}
    # The layout whose best per bucket loses least, summed over buckets, to the best of either layout
    # (a ratio, so one-row steps weigh as much as 64-node trees); ties keep the weight as it is.
    regret = {lay: sum(bests[lay][m][0] / min(bests[q][m][0] for q in layouts) for m in buckets) for lay in layouts}
    layout = min(layouts, key=lambda lay: (regret[lay], lay != stored_as(w)))
    plan = ShapePlan(layout=layout, ms={Timing(*k): round(v, 4) for k, v in ms.items()})
    if invariant:
        plan.kernel, plan.rows, plan.layout = _invariant_option(cands, w, bests, ms, buckets)
    else:
        plan.by_bucket = {m: bests[layout][m][1] for m in buckets}
    return plan


def default_layouts(w: torch.Tensor, invariant: bool) -> tuple[str, ...]:
    """The layouts a shape's weight is timed in: rows, and the one other layout its precision may
    use where the weight takes it (float32: transposed; an invariant plan: panels)."""
    other = ("panel", panelable) if invariant else ("col", transposable)
    return ("row", other[0]) if other[1](w) else ("row",)


def _call_of(fn, x: torch.Tensor, w: torch.Tensor, bare: bool):
    """What is timed of ``fn`` on ``w``: its call; with ``bare`` (an invariant plan, whose forwards
    run in the native decoder where it is built) a native kernel alone on operands made ready once
    (``native._kernel``), as the decoder calls it, and every call on a weight dropped from the caches
    first (``before``, not timed), as a forward streams each weight from memory: hot in the caches,
    a kernel that keeps more FMA chains in flight wins what a forward never sees."""
    if bare and hasattr(fn, "bare"):
        call = fn.bare(x, w)
        timed = lambda _x: call()  # noqa: E731
    else:
        timed = lambda x_, fn=fn, w=w: fn(x_, w, None)  # noqa: E731
    if bare:
        timed.before = lambda: native.flush(w)
    return timed


def _checked_calls(cands: dict, w: torch.Tensor, stored: dict, inputs: dict, bare: bool = False) -> tuple[dict, dict]:
    """The calls on ``w`` stored each way that agree with ``F.linear``, keyed (kernel, layout, rows)
    (``bare``: native kernels alone, ``_call_of``), and the candidates too slow to time at larger
    buckets: (kernel, layout) -> the last rows tried."""
    rows = in_layout(w, "row")  # the weight's values, whichever layout it is stored in
    refs = {m: F.linear(x, rows) for m, x in inputs.items()}
    fns, slow = {}, {}
    for lay, wl in stored.items():
        for name, fn in cands.items():
            for m in inputs if lay in kernels.reads(name) else ():
                if name == "dup" and m != 1:
                    continue  # the same as wxt beyond one row
                if (name, lay) in slow:  # bounded tuning: a candidate this slow is extrapolated, not timed, beyond
                    continue
                try:
                    t0 = time.perf_counter()
                    ok = _agrees(fn(inputs[m], wl, None), refs[m])
                    if time.perf_counter() - t0 > SLOW_CALL_S:
                        slow[(name, lay)] = m
                except (RuntimeError, TypeError):  # e.g. oneDNN without a kernel for this dtype on this CPU
                    ok = False
                if ok:
                    fns[(name, lay, m)] = _call_of(fn, inputs[m], wl, bare)
    return fns, slow


def _measure(fns: dict, inputs: dict, reps: int) -> dict:
    """Median milliseconds per call (``_time``: one round per row count, after a warm-up call);
    fewer repetitions when calls are slow, more when they are cheap (against a noisy machine, still
    milliseconds)."""
    top = max((k[2] for k in fns), default=0)
    first = max(_time({k: f for k, f in fns.items() if k[2] == top}, inputs, 1).values(), default=0.0)
    if first * len(fns) * reps > TUNE_SECONDS / 4:
        reps = 3
    elif first < 2e-3:
        reps = 3 * reps
    return {k: v * 1e3 for k, v in _time(fns, inputs, reps).items()}


def _best_per_bucket(ms: dict, layout: str, buckets) -> dict[int, tuple[float, str]]:
    """Bucket -> (milliseconds, kernel) of the fastest call with the weight stored as ``layout``."""
    return {
        m: min(((v, k[0]) for k, v in ms.items() if k[1] == layout and k[2] == m), default=(math.inf, "linear"))
        for m in buckets
    }


def _invariant_option(cands: dict, w: torch.Tensor, bests: dict, ms: dict, buckets) -> tuple[str, int, str]:
    """(kernel, rows per chunk, layout) of an invariant plan: fixed chunks of r rows (the fastest
    kernel at r on a layout, checked to be position invariant, else the next option; one row always
    is), or a row-invariant kernel unchunked (rows 0). ``bests``: per layout timed, bucket ->
    (ms, kernel) of its fastest call.

    The rule: one token first. Every decode step (all of ``off``, and each step a draft is not
    tried) is a one-row call, so only the options within ``ONE_ROW_SLACK`` of the fastest one-row
    option are eligible (a chunk of r rows computes r rows for one: it is eligible only where r
    rows cost about what one does); among them the one whose slowdowns against the best option at
    each tree size sum least (a ratio, so a one-token step weighs as much as a 64-node tree). One-row
    chunks of the fastest one-row kernel are always eligible (and invariant), whatever the timings'
    noise."""
    options = {}
    for lay, best in bests.items():
        # chunks of a row-invariant kernel are that kernel unchunked, timed at every bucket itself:
        # only its one-row chunks (the fallback) are kept, so noise cannot pick padded chunks of it
        for r in buckets:
            if r == 1 or not kernels.row_invariant(best[r][1]):
                options[("chunks", r, best[r][1], lay)] = [math.ceil(n / r) * best[r][0] for n in buckets]
        for name in cands:
            if kernels.row_invariant(name) and all((name, lay, n) in ms for n in buckets):
                options[("whole", 0, name, lay)] = [ms[(name, lay, n)] for n in buckets]
    low = [min(costs[i] for costs in options.values()) for i in range(len(buckets))]
    slowdown = {opt: sum(c / lo for c, lo in zip(costs, low)) for opt, costs in options.items()}
    one = buckets.index(1) if 1 in buckets else 0
    eligible = [o for o, c in options.items() if c[one] <= ONE_ROW_SLACK * low[one] or o[:2] == ("chunks", 1)]
    for how, r, name, lay in sorted(eligible, key=lambda o: (slowdown[o], o[1], o[3] != stored_as(w))):
        if how == "whole" or r == 1 or position_invariant(cands[name], in_layout(w, lay), r):
            return name, r, lay
    raise AssertionError("unreachable: one-row chunks are eligible and invariant")


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


def _agrees(y: torch.Tensor, ref: torch.Tensor) -> bool:
    if y.shape != ref.shape or not torch.isfinite(y).all():
        return False
    tol = 1e-4 if y.dtype == torch.float32 else 2e-2
    scale = ref.float().abs().max().item() + 1e-6
    return (y.float() - ref.float()).abs().max().item() <= tol * scale * math.sqrt(max(1, ref.shape[-1] / 64))


def _time(fns: dict, inputs: dict, reps: int, clock=None) -> dict:
    """Median seconds per key (its last element: the rows). Each row count is timed in rounds of its
    own: a warm-up call of every candidate at that count (not counted), then up to ``ROUND_REPS``
    repetitions with the candidates interleaved, so each call timed follows calls of its own row
    count (a one-row figure is not a one-row call from caches a 64-row call of another kernel left
    cold). More repetitions take more rounds, the row counts visited in turn, so a machine's drift
    falls on every row count, not on one round's."""
    clock = clock or time.perf_counter  # read at the call: a test may stand in for ``time``
    times = {k: [] for k in fns}
    counts = list(dict.fromkeys(k[-1] for k in fns))
    for done in range(0, reps, ROUND_REPS):
        for rows in counts:
            round_ = {k: fn for k, fn in fns.items() if k[-1] == rows}
            for rep in range(min(ROUND_REPS, reps - done) + 1):
                for k, fn in round_.items():
                    if hasattr(fn, "before"):
                        fn.before()
                    t0 = clock()
                    fn(inputs[rows])
                    if rep:
                        times[k].append(clock() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


# -- a whole forward -------------------------------------------------------------------------------


def _best_in(sp: ShapePlan, layout: str, m: int) -> str | None:
    """The fastest kernel of a shape's own timings at ``m`` rows with its weight stored as ``layout``."""
    times = {t.kernel: v for t, v in sp.ms.items() if not t.forward and t.layout == layout and t.rows == m}
    return min(times, key=times.__getitem__) if times else None


def _fits(sp: ShapePlan, kernel: str, layout: str, m: int) -> bool:
    """Whether a uniform option may run ``kernel`` on this shape: it can read the layout, and the
    shape's own timing (where there is one) was not far off its best (some kernels are pathological
    on one layout: ``W @ x.T`` over a transposed output layer takes seconds)."""
    if layout not in kernels.reads(kernel):
        return False
    own = sp.ms.get(Timing(kernel, layout, m))
    best = _best_in(sp, layout, m)
    return own is None if best is None else own is not None and own <= 2 * sp.ms[Timing(best, layout, m)]


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
        apply_layouts(model, layouts)
        params = [p.detach() for p in all_projections(model)]  # the weights as the forward reads them
        results[tag] = {}
        for m in buckets:
            per_shape = {
                s: (sp.by_bucket[m] if layouts[s] == sp.layout else None) or _best_in(sp, layouts[s], m) or "linear"
                for s, sp in shapes.items()
            }
            options: dict[str, dict] = {"per-shape": per_shape}
            for k in sorted(kernels_won):
                if not kernels.usable(k, params[0].device, params[0].dtype):
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
    apply_layouts(model, configs[win])
    kept = {}
    for m in buckets:
        t, best, choice = results[win][m]
        for s, sp in shapes.items():
            sp.layout = configs[win][s]
            sp.by_bucket[m] = choice[s]
            sp.ms[Timing(best, sp.layout, m, forward=True)] = round(t * 1e3, 3)
        kept[m] = win + best
    return kept
