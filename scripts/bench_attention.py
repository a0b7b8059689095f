"""Invariant tree attention alone, one layer, by tree size and context: native (context read in place;
each of its paths that runs here: ``native-amx``, AMX tiles, and ``native-vector``, float32 vectors)
against gathered rows (each row's keys copied), and fused SDPA (not invariant) for scale.

    PYTHONPATH=. python scripts/bench_attention.py --threads 2 --contexts 256,800,2000 --dtype bfloat16

Heads as SmolLM2-135M's (9 query heads over 3 KV heads of 64). Trees are random (every node's
parent drawn among the earlier ones), one per size; times are medians of ``--reps`` calls, the
sizes and ways interleaved within each repetition. Prints ms per layer call and the ratio to the
same way's one-token call, and which native path this process would pick at start-up.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from tests.support.trees import random_tree
from verifier import llama, native

SIZES = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--contexts", default="256,2000")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim = 9, 3, 64
    rng = random.Random(0)
    paths = (
        native.attention_paths(dtype, heads, kv_heads, dim)
        if native.attention_usable(dtype, torch.device("cpu"), dim)
        else ()
    )
    ways = [f"native-{p}" for p in paths] + ["gathered", "sdpa"]
    print(f"{torch.get_num_threads()} threads, {args.dtype}, one layer, ms (x its one-token call)")
    if paths:
        print(f"native path picked at start-up here: {native.attention_path(dtype, heads, kv_heads, dim)}")
    print("| context | way | " + " | ".join(str(n) for n in SIZES) + " |")
    print("|---|---|" + "---|" * len(SIZES))
    for past in (int(c) for c in args.contexts.split(",")):
        kv = torch.randn((2, kv_heads, past + max(SIZES) + llama._KEY_BLOCK, dim)).to(dtype)
        cases = {}
        for n in SIZES:
            mask, _ = random_tree(rng, past, n)
            q = torch.randn((n, heads, dim)).to(dtype)
            keys = llama._row_keys(mask, past, n)
            groups = llama._row_groups(mask, past, n, "cpu", dtype)
            add = llama._additive(mask, dtype, "cpu")
            cases[n] = (q, keys, groups, add)

        def run(way, n):
            q, keys, groups, add = cases[n]
            if way.startswith("native-"):
                native.attention(q, kv, *keys, 0.125, path=way.removeprefix("native-"))
            elif way == "gathered":
                llama._rows_attention(q.transpose(0, 1)[None], kv, groups, 0.125, True)
            else:
                F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],
                    kv[0, :, : past + n][None],
                    kv[1, :, : past + n][None],
                    attn_mask=add,
                    scale=0.125,
                    enable_gqa=True,
                )

        times = {(w, n): [] for w in ways for n in SIZES}
        with torch.inference_mode():
            for rep in range(args.reps + 1):
                for n in SIZES:
                    for w in ways:
                        t0 = time.perf_counter()
                        run(w, n)
                        if rep:
                            times[(w, n)].append((time.perf_counter() - t0) * 1e3)
        for w in ways:
            one = statistics.median(times[(w, 1)])
            cells = [
                f"{statistics.median(times[(w, n)]):.3f} ({statistics.median(times[(w, n)]) / one:.1f}x)" for n in SIZES
            ]
            print(f"| {past} | {w} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
