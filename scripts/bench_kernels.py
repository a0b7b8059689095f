"""Verifier cost curves side by side, one per kernel plan: what the measured choice buys on this machine.

Each plan gets its own copy of the model (a plan may store weights transposed, in place), one
verifier session over the same random ``--context``-token cache, and chain trees of every size;
the plans and sizes are interleaved within each repetition, so drift on a shared machine falls on
all of them alike. Prints the plans' descriptions and a table of medians (ms per verification:
forward, logits, top-k, acceptance), with each curve's ratio to its one-node step.

    PYTHONPATH=. python scripts/bench_kernels.py [--threads 1] [--plans tune,linear,blas@col]

A plan is ``tune`` (measured now, not read from the cache), ``auto`` (the cached choice, else
measured) or a forced ``RACER_KERNELS`` spec (``linear``, ``wxt``, ``onednn``, ``blas@col``,
``native6x2``, ...); ``/no-native`` after a plan leaves the native kernels out of its candidates
(``tune/no-native``: the choice a machine without a C compiler makes); ``/unpacked`` leaves the
weights where the loader put them (``verifier/arena.py``; for ``--dtype gguf``, the GGUF blocks as
the file stores their rows instead of in groups of 8); both may follow one plan. ``--dtype
gguf,bfloat16,float32`` runs every plan in each dtype, interleaved the same way.

A plan served from GGUF blocks also gets the bytes of blocks its one-node step reads against the
machine's streaming read bandwidth (``--stream-mib`` of memory read by the native library's read
loop, one contiguous run per thread, interleaved with the verifications): how near the memory limit a
one-token step runs.

``--blocks`` times the block kernel (``native_quant.c``) alone instead, on random weights of the
given formats and shapes (``out x in``), each as the file stores its rows (``rows``), packed in
groups of 8 (``packed``) or packed and multiplied on AMX-INT8 tiles (``amx``, where the CPU has
them), at each of ``--sizes`` rows and each of ``--threads`` (a list here), all interleaved,
microseconds a call: the median and the best of ``--reps`` batches of ``--calls`` calls (on a shared machine the
best is the least disturbed):

    PYTHONPATH=. python scripts/bench_kernels.py --blocks Q5_0/packed,Q4_1/packed,Q5_0/rows,Q4_1/amx \
        --weights 576x1536,1536x576 --sizes 1,4,16 --threads 1,2 --reps 15

With ``--peak`` it also prints each cell as multiply-adds a second per thread, against the fastest 8-bit
multiply-add instruction this CPU has, timed alone on as many threads at once (``scripts/int8_peak.c``:
vpmaddubsw on AVX2, vpdpbusd on 256 and 512 bits with VNNI): how much of the integer rate the
kernel's unpacking, scales and float steps leave.

``--sessions`` times what batching pays instead: N sessions' one-node steps in one forward
(``verify_batch``, each session over its own ``--context``-token cache) beside one session's chain
tree of N nodes, interleaved the same way. The weights are read once either way; what differs is
that each session's rows attend over a cache of their own, which the chain's rows share:

    PYTHONPATH=. python scripts/bench_kernels.py --dtype gguf --plans auto --sessions 1,2,4,8 --reps 15
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from verifier.engine import VerifierSession, verify_batch  # noqa: E402
from verifier.kernels import Timing  # noqa: E402
from verifier.machine import fingerprint  # noqa: E402
from verifier.model import DEFAULT_MODEL, load  # noqa: E402
from verifier.tuning import kernel_plan  # noqa: E402


def shape_table(plan) -> None:
    """The tuner's own medians (ms per call of one shape alone, weight stored as the plan keeps it),
    one row per kernel, one column per bucket; the kept kernel marked."""
    for (o, i), sp in plan.shapes.items():
        timed = {t for t in sp.ms if not t.forward and t.layout == sp.layout}
        rows = sorted({t.rows for t in timed})
        kept = {sp.kernel} if plan.invariant else set(sp.by_bucket.values())
        chunks = f", {sp.rows}-row chunks" if plan.invariant and sp.rows else ""
        print(f"\n{o}x{i} ({sp.layout}): ms per call by rows")
        print("| kernel | " + " | ".join(map(str, rows)) + " |")
        print("|---|" + "---|" * len(rows))
        for k in sorted({t.kernel for t in timed}):
            cells = [sp.ms.get(Timing(k, sp.layout, r)) for r in rows]
            mark = f" (kept{chunks})" if k in kept else ""
            print(f"| {k}{mark} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    print(flush=True)


def block_table(args) -> None:
    """``--blocks``: the block kernel's median and best per format and layout, weight, rows, threads."""
    from verifier import native, native_check

    lib = native.library()
    if lib is None:
        raise SystemExit(f"no native library: {native.why()}")
    specs = [(f, layout or "packed") for f, _, layout in (s.partition("/") for s in args.blocks.split(","))]
    shapes = [tuple(int(v) for v in w.split("x")) for w in args.weights.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(t) for t in str(args.threads).split(",")]
    gen = torch.Generator().manual_seed(0)
    weights = {}
    if any(layout == "amx" for _, layout in specs) and not native.quant_amx():
        raise SystemExit("no AMX-INT8 tiles here (the CPU, Linux or the start-up check said no)")
    for n, k in shapes:
        for fmt, layout in specs:
            kind = native_check.FORMATS[fmt][0]
            data = native_check._blocks(fmt, n, k, gen)
            if layout in ("packed", "amx"):
                packed = native.quant_pack(kind, data, n, k)
                if packed is None:
                    raise SystemExit(f"{fmt} is not packed here")
                kind, data = packed
            weights[(n, k, fmt, layout)] = (kind, data)
    xs = {(k, m): torch.randn((m, k), generator=gen) for _, k in shapes for m in sizes}
    keys = [(t, w, m) for t in counts for w in weights for m in sizes]
    times = {key: [] for key in keys}
    for rep in range(args.reps + 1):  # the first pass warms up and is not counted
        random.Random(rep).shuffle(keys)
        for t, (n, k, fmt, layout), m in keys:
            torch.set_num_threads(t)
            kind, data = weights[(n, k, fmt, layout)]
            x = xs[(k, m)]
            lib.racer_pool_hold(1)  # as a forward holds the pool over its calls
            native.quant_amx_rows(1 if layout == "amx" else 0)  # tiles for every call of 2 rows or more
            t0 = time.perf_counter()
            for _ in range(args.calls):
                native.quant_linear(x, kind, data, n, k)
            elapsed = time.perf_counter() - t0
            lib.racer_pool_hold(0)
            if rep:
                times[(t, (n, k, fmt, layout), m)].append(elapsed / args.calls * 1e6)
    cpu = fingerprint()["cpu"]
    print(f"\n{cpu}, block kernel {native.quant_isa()}, {args.reps} x {args.calls} calls: median / best (us a call)")
    head = " | ".join(f"{t} thr, {m} rows" for t in counts for m in sizes)
    print(f"| weight | format | {head} |")
    print("|---|---|" + "---|" * (len(counts) * len(sizes)))
    for n, k, fmt, layout in weights:
        cells = [times[(t, (n, k, fmt, layout), m)] for t in counts for m in sizes]
        cells = [f"{statistics.median(c):.1f} / {min(c):.1f}" for c in cells]
        print(f"| {n}x{k} | {fmt} {layout} | " + " | ".join(cells) + " |")
    if args.peak:
        peak_table(args, weights, times, counts, sizes)


def int8_peaks(counts: list[int]) -> dict[int, tuple[float, dict[str, float]]]:
    """scripts/int8_peak.c built once for this CPU and run on each of ``counts`` threads at once:
    per count, the clock (GHz) and, per instruction it has, G multiply-adds a second of each thread."""
    import subprocess
    import tempfile

    from verifier import native

    cc = native._compiler()
    if cc is None:
        raise SystemExit("--peak: no C compiler")
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_peak"
        src = Path(__file__).with_name("int8_peak.c")
        subprocess.run([cc, "-O2", "-march=native", "-pthread", str(src), "-o", str(exe)], check=True)
        for threads in counts:
            out = subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout
            lines = out.splitlines()
            rates = {}
            for line in lines[1:]:
                name, rate, _ = line.rsplit(" ", 2)
                rates[name] = float(rate)
            peaks[threads] = (float(lines[0].split()[1]), rates)
    return peaks


def peak_table(args, weights, times, counts, sizes) -> None:
    """Each cell's best time as G multiply-adds a second per thread, and its share of the fastest
    8-bit multiply-add instruction's peak on as many threads at once (scripts/int8_peak.c)."""
    peaks = int8_peaks(counts)
    for t, (ghz, rates) in peaks.items():
        listed = ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())
        print(f"\npeak, {t} thread(s) at once (clock {ghz:.2f} GHz): {listed} G multiply-adds a second per thread")
    head = " | ".join(f"{t} thr, {m} rows" for t in counts for m in sizes)
    print("\nG multiply-adds a second per thread (best time) / share of the fastest instruction's peak")
    print(f"| weight | format | {head} |")
    print("|---|---|" + "---|" * (len(counts) * len(sizes)))
    for n, k, fmt, layout in weights:
        cells = []
        for t in counts:
            top = max(peaks[t][1].values())
            for m in sizes:
                rate = n * k * m / (min(times[(t, (n, k, fmt, layout), m)]) * 1e-6) / 1e9 / t
                cells.append(f"{rate:.1f} / {rate / top:.0%}")
        print(f"| {n}x{k} | {fmt} {layout} | " + " | ".join(cells) + " |")


def block_bytes(sessions) -> dict[str, int]:
    """Per plan served from GGUF blocks, the bytes of blocks a one-node step reads (every projection
    and the output layer; the float32 norms and one embedding row aside)."""
    out = {}
    for spec, session in sessions.items():
        model = session.model
        nbytes = sum(m.racer_blocks.data.nbytes for m in model.modules() if getattr(m, "racer_blocks", None))
        if nbytes:
            out[spec] = nbytes
    return out


class Stream:
    """The machine's streaming read bandwidth on ``threads`` threads: a buffer far larger than the
    caches read by the native library's read loop (each thread one contiguous run), on the kernels'
    pool held as a forward holds it."""

    def __init__(self, threads: int, mib: int):
        from verifier import native

        self.lib = native.library()
        self.threads = threads
        self.buf = torch.ones(mib << 20, dtype=torch.uint8)  # written once: every page is there
        self.times: list[float] = []

    def measure(self, keep: bool) -> None:
        self.lib.racer_pool_hold(1)
        t0 = time.perf_counter()
        self.lib.racer_stream_read(self.buf.data_ptr(), self.buf.numel(), self.threads)
        elapsed = time.perf_counter() - t0
        self.lib.racer_pool_hold(0)
        if keep:
            self.times.append(elapsed)

    def median(self) -> float:
        """GB/s."""
        return self.buf.numel() / statistics.median(self.times) / 1e9


def plan_session(args, label: str, dtypes: list[str]):
    """A verifier session of ``args.model`` on the kernel plan ``label`` names, over a prefilled
    context of ``args.context`` random tokens."""
    dtype, name = label.split(" ") if len(dtypes) > 1 else (dtypes[0], label)
    spec, *options = name.split("/")
    os.environ["RACER_KERNELS"] = spec  # what the session's backend asks for, too
    os.environ["RACER_NATIVE"] = "off" if "no-native" in options else "on"
    os.environ["RACER_PACK"] = "off" if "unpacked" in options else "on"
    model = load(args.model, dtype=dtype, tokenizer=False).model
    t0 = time.perf_counter()
    plan = kernel_plan(model)
    print(f"{label}: {plan.describe()} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if args.shapes:
        shape_table(plan)
    vocab = model.config.vocab_size
    session = VerifierSession(model)
    assert session.backend.plan is plan, "the session must run the plan it is named after"
    session.prefill([random.Random(1).randrange(vocab) for _ in range(args.context)])
    return session


def time_sizes(sessions: dict, sizes: list[int], args, stream: Stream | None) -> dict:
    """(plan, size) -> ms of each counted verification of a chain tree of that size, the sizes and
    plans interleaved within each repetition (and the streaming read, when measured, after each
    size). Each timed verification follows an untimed one-token step, as a round follows a round
    and as the verifier measures its cost curve: timed right after a 64-node tree, a one-token step
    of the default model took 5.2 ms against 4.6 back to back."""
    rng = random.Random(0)
    vocab = next(iter(sessions.values())).vocab_size
    trees = {n: ([rng.randrange(vocab) for _ in range(n)], [-1, *range(n - 1)]) for n in sizes}
    step = ([rng.randrange(vocab)], [-1])
    times = {(spec, n): [] for spec in sessions for n in sizes}
    for rep in range(args.reps + 1):  # the first pass warms up and is not counted
        for n in sizes:
            for spec, session in sessions.items():
                session.verify(*step)
                session.truncate(args.context)
                t0 = time.perf_counter()
                session.verify(*trees[n])
                if rep:
                    times[(spec, n)].append((time.perf_counter() - t0) * 1e3)
                session.truncate(args.context)
            if stream is not None:
                stream.measure(keep=rep > 0)
    return times


def time_sessions(sessions: dict, counts: list[int], args) -> dict:
    """(plan, n, "batch" | "chain") -> ms of each counted forward: n sessions' one-node steps
    verified together, and one session's chain of n nodes; each after an untimed one-token step
    of every session it times, as in ``time_sizes``."""
    rng = random.Random(0)
    vocab = next(iter(sessions.values())).vocab_size
    pools = {}
    for spec, first in sessions.items():  # the first session and the others, each over its own cache
        pools[spec] = [first]
        for i in range(1, max(counts)):
            other = VerifierSession(first.model)
            other.prefill([random.Random(100 + i).randrange(vocab) for _ in range(args.context)])
            pools[spec].append(other)
    times = {(spec, n, kind): [] for spec in sessions for n in counts for kind in ("batch", "chain")}
    for rep in range(args.reps + 1):  # the first pass warms up and is not counted
        for n in counts:
            for spec, pool in pools.items():
                for kind in ("batch", "chain"):
                    group = pool[:n] if kind == "batch" else pool[:1]
                    verify_batch([(s, [rng.randrange(vocab)], [-1]) for s in group])
                    for s in group:
                        s.truncate(args.context)
                    if kind == "batch":
                        items = [(s, [rng.randrange(vocab)], [-1]) for s in group]
                    else:
                        items = [(pool[0], [rng.randrange(vocab) for _ in range(n)], [-1, *range(n - 1)])]
                    t0 = time.perf_counter()
                    verify_batch(items)
                    if rep:
                        times[(spec, n, kind)].append((time.perf_counter() - t0) * 1e3)
                    for s in group:
                        s.truncate(args.context)
    return times


def session_table(sessions: dict, args) -> None:
    counts = [int(s) for s in args.sessions.split(",")]
    times = time_sessions(sessions, counts, args)
    cpu = fingerprint()["cpu"]
    print(
        f"\n{cpu}, {args.threads} thread(s), {args.dtype}, each session over {args.context} tokens, "
        f"medians of {args.reps} (ms a forward)"
    )
    print("| plan | n | n sessions, one node each | one session, a chain of n nodes | sessions / chain |")
    print("|---|---|---|---|---|")
    for spec in sessions:
        for n in counts:
            batch = statistics.median(times[(spec, n, "batch")])
            chain = statistics.median(times[(spec, n, "chain")])
            print(f"| {spec} | {n} | {batch:.1f} | {chain:.1f} | {batch / chain:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32", help="comma-separated: each dtype x plan is one curve")
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="a list with --blocks")
    ap.add_argument("--plans", default="tune,linear")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", action="store_true", help="also print each plan's per-shape tuner timings")
    ap.add_argument(
        "--blocks", default="", help="FORMAT/packed, FORMAT/rows or FORMAT/amx, comma-separated: the kernel alone"
    )
    ap.add_argument("--weights", default="576x1536,1536x576", help="--blocks: weight shapes, out x in")
    ap.add_argument("--calls", type=int, default=20, help="--blocks: calls per timed batch")
    ap.add_argument(
        "--peak",
        action="store_true",
        help="--blocks: also each cell's multiply-adds a second against the CPU's 8-bit peak (scripts/int8_peak.c)",
    )
    ap.add_argument("--sessions", default="", help="counts of sessions batched, beside chains as long (1,2,4,8)")
    ap.add_argument(
        "--stream-mib",
        type=int,
        default=1024,
        help="gguf plans: MiB of the streaming read the one-node step's weight bytes are compared with (0: none)",
    )
    args = ap.parse_args()
    if args.blocks:
        block_table(args)
        return
    args.threads = int(args.threads)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    dtypes = args.dtype.split(",")
    plans = [f"{d} {p}" if len(dtypes) > 1 else p for d in dtypes for p in args.plans.split(",")]
    sessions = {label: plan_session(args, label, dtypes) for label in plans}
    if args.sessions:
        session_table(sessions, args)
        return
    stream = Stream(args.threads, args.stream_mib) if args.stream_mib and block_bytes(sessions) else None
    times = time_sizes(sessions, sizes, args, stream)
    cpu = fingerprint()["cpu"]
    print(
        f"\n{cpu}, {args.threads} thread(s), {args.dtype}, {args.context}-token context, chain trees, "
        f"medians of {args.reps} (ms)"
    )
    print("| plan | " + " | ".join(str(n) for n in sizes) + f" | {sizes[-1]} / {sizes[0]} |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for spec in plans:
        med = [statistics.median(times[(spec, n)]) for n in sizes]
        print(f"| {spec} | " + " | ".join(f"{m:.1f}" for m in med) + f" | {med[-1] / med[0]:.1f} |")
    if stream is not None and 1 in sizes:
        gbs = stream.median()
        print(
            f"\nstreaming read: {gbs:.1f} GB/s ({args.stream_mib} MiB, {args.threads} thread(s), "
            f"racer_stream_read, median of {len(stream.times)}, interleaved with the verifications)"
        )
        print("| plan | block bytes a one-node step reads | one-node step | bytes / step time | share of streaming |")
        print("|---|---|---|---|---|")
        for spec, nbytes in block_bytes(sessions).items():
            ms = statistics.median(times[(spec, 1)])
            rate = nbytes / ms / 1e6
            print(f"| {spec} | {nbytes / 1e6:.1f} MB | {ms:.2f} ms | {rate:.1f} GB/s | {100 * rate / gbs:.0f}% |")


if __name__ == "__main__":
    main()
