"""Prompts of several sessions prefilled one at a time and in one forward (``prefill_batch``).

The verifier's own kernels (the measured plan) and llama backend, the default model in float32 unless
``--model`` or ``--dtype`` say otherwise; for each shape (prompts x tokens) both ways, interleaved
within each repetition (the first pass is not counted), medians in ms and their ratio.

    PYTHONPATH=. python scripts/bench_prefill.py [--threads 1] [--shapes 16x32,16x8,8x64] [--reps 3]
        [--dtype bfloat16] [--shared 24] [--topk-rows 0]

``--shared N``: every prompt begins with the same N of its tokens (a chat template's system prompt:
24 of the burst's 36-45 tokens for the default model), which a batch prefills once in float32.
``--topk-rows R``: the top-k of each prompt's last R positions only (default: every position).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scripts.bench_prompts import prompts_with_common_head  # noqa: E402
from verifier.engine import VerifierSession, prefill_batch  # noqa: E402
from verifier.model import load  # noqa: E402
from verifier.tuning import kernel_plan  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--shapes", default="16x32,16x8,8x64", help="prompts x tokens, comma separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--shared", type=int, default=0, help="leading tokens every prompt has in common")
    ap.add_argument("--topk-rows", type=int, default=None, help="top-k of each prompt's last R positions")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load(args.model, args.dtype, args.threads or None, False).model
    kernel_plan(model)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    print(
        f"threads={torch.get_num_threads()} model={args.model} {args.dtype} shared={args.shared} "
        f"topk_rows={'all' if args.topk_rows is None else args.topk_rows}"
    )
    print("| prompts x tokens | one at a time ms | one forward ms | ratio |")
    print("|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, tokens = map(int, shape.split("x"))
        prompts = prompts_with_common_head(rng, vocab, [tokens] * n, args.shared)
        times: dict[str, list[float]] = {"alone": [], "together": []}
        for rep in range(args.reps + 1):
            for kind in ("alone", "together") if rep % 2 == 0 else ("together", "alone"):
                sessions = [VerifierSession(model, backend="llama", capacity=0) for _ in prompts]
                t0 = time.perf_counter()
                if kind == "alone":
                    for s, p in zip(sessions, prompts):
                        s.prefill(p, True, args.topk_rows)
                else:
                    prefill_batch([(s, p, True, args.topk_rows) for s, p in zip(sessions, prompts)])
                if rep:
                    times[kind].append((time.perf_counter() - t0) * 1e3)
        alone, together = (statistics.median(times[k]) for k in ("alone", "together"))
        print(f"| {n} x {tokens} | {alone:.0f} | {together:.0f} | {alone / together:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
