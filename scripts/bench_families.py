"""The target-family table: backend, lossless at budgets 1/8/64, tok/s against HF greedy.

Every family's tiny random-weight model of racer/bench/tiny.py (built here, nothing is
downloaded), one torch thread, an echo prompt (it holds a stretch of its own continuation, so
drafts get accepted as they would on repetitive real text). Lossless: racer output equal to
``model.generate(do_sample=False)`` token for token. tok/s: new tokens over wall time, median of
``--reps``, racer at ``--budget``.

    PYTHONPATH=. python scripts/bench_families.py [--tokens 64] [--budget 16] [--reps 3] [names...]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from racer.bench.reference import hf_greedy, run_racer  # noqa: E402
from racer.bench.tiny import FAMILIES, backend_kind, echo_prompt, make  # noqa: E402
from verifier.engine import VerifierSession  # noqa: E402
from verifier.layouts import loaded_layout  # noqa: E402


def timed(fn, reps: int) -> tuple[object, float]:
    fn()  # warm-up: kernel selection, the backend's probe
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=list(FAMILIES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    print(
        "| family | model_type | backend | lossless 1/8/64 | HF greedy tok/s "
        f"| racer tok/s (budget {args.budget}) | speed-up | MAT |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.names:
        m = make(name)
        kind = backend_kind(VerifierSession(m).backend)
        prompt = echo_prompt(m)
        with loaded_layout(m):  # HF as loaded: the llama backend may have stored weights transposed
            ref = hf_greedy(m, prompt, args.tokens)
            _, t_hf = timed(lambda: hf_greedy(m, prompt, args.tokens), args.reps)
        ok = [run_racer(m, list(prompt), "auto", max_new_tokens=args.tokens, budget=b)[0] == ref for b in (1, 8, 64)]
        (out, stats, _), t_racer = timed(
            lambda: run_racer(m, list(prompt), "auto", max_new_tokens=args.tokens, budget=args.budget), args.reps
        )
        assert out == ref
        n = args.tokens
        print(
            f"| {name} | {m.config.model_type} | {kind} | {'/'.join('yes' if x else 'NO' for x in ok)} "
            f"| {n / t_hf:.0f} | {n / t_racer:.0f} | {t_hf / t_racer:.2f}x | {stats.mat:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
