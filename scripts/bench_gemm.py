"""The native projection kernels side by side: the row tiles (native_linear.c) over weights stored as
rows against the panel kernel (native_panel.c) over the same weights stored as panels.

A verification step streams every weight from memory, so each call here reads a weight the caches
no longer hold: copies of each shape (``--copies-bytes`` of them, past the last-level cache) are
taken in turn. Each kernel is called alone on operands made ready once, as the native decoder calls
it (the checks and casts of the Python wrapper cost about as much as a one-row kernel). The
kernels alternate within each repetition, so a shared machine's drift falls on all of them; the
table holds medians (ms per call) and each kernel's speed-up over the first tile.

    PYTHONPATH=. python scripts/bench_gemm.py [--threads 2] [--dtype bfloat16] [--rows 1,4,16,64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from verifier import layouts, native  # noqa: E402
from verifier.machine import cpu_identity  # noqa: E402

SHAPES = "576x576,192x576,1536x576,576x1536,49152x576"  # the default model's projections and output layer


def kernels(dtype: torch.dtype) -> dict:
    """name -> (kernel, the layout it reads), for every native kernel built here for ``dtype``."""
    found = {
        n: (native.linear(n), "row")
        for n in native.VARIANTS
        if n not in native.PAIRS and native.usable(n, cpu_identity()) and dtype in native.dtypes(n)
    }
    if native.panel_width() and dtype != torch.float32:
        found[native.PANEL] = (native.linear_panel, layouts.PANEL)
    return found


def bench_shape(n: int, k: int, rows: list[int], dtype, reps: int, budget: float) -> list[list[str]]:
    found = kernels(dtype)
    copies = max(2, int(budget // (n * k * torch.finfo(dtype).bits // 8)))
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn((n, k), generator=g) / k**0.5).to(dtype) for _ in range(copies)]
    stored = {lay: [layouts.in_layout(w, lay) for w in weights] for lay in {lay for _, lay in found.values()}}
    table = []
    for m in rows:
        x = torch.randn((m, k), generator=g).to(dtype)
        calls = {name: [fn.bare(x, w) for w in stored[lay]] for name, (fn, lay) in found.items()}
        times = {name: [] for name in found}
        for _ in range(reps):
            for name, run in calls.items():
                t0 = time.perf_counter()
                for call in run:
                    call()
                times[name].append((time.perf_counter() - t0) / copies * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        base = next(iter(med.values()))
        table.append([f"{n}x{k}", str(m), *(f"{v:.3f} ({base / v:.2f}x)" for v in med.values())])
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--copies-bytes", type=float, default=80e6, help="bytes of weight copies per shape")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    names = list(kernels(dtype))
    if not names:
        sys.exit(f"no native kernels here: {native.why()}")
    print(f"{cpu_identity()}; {args.threads} threads; {args.dtype}; ms per call (speed-up over {names[0]})")
    print("| shape | rows | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    rows = [int(r) for r in args.rows.split(",")]
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        for line in bench_shape(n, k, rows, dtype, args.reps, args.copies_bytes):
            print("| " + " | ".join(line) + " |", flush=True)


if __name__ == "__main__":
    main()
