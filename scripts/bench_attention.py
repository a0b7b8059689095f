"""Tree attention against one token, by tree size and context, in float32 and bfloat16: one layer's
attention alone, and a whole verification round of the model.

    PYTHONPATH=. python scripts/bench_attention.py --threads 2 --contexts 256,800,2000 --sizes 1,16,64

Attention alone: heads as SmolLM2-135M's (9 query heads over 3 KV heads of 64), one layer, each way
that runs here: ``native-amx`` (AMX tiles) and ``native-vector`` (float32 vectors), the invariant
attention over the cache in place (``verifier/native_attention.c``); ``sdpa``, fused SDPA over a
tree mask (what float32 runs: not invariant); ``gathered`` (with ``--gathered``), each row's keys
copied, the invariant attention without the native library. A whole round: one verification (the
forward, the logits, acceptance) of a tree by a verifier session of ``--model`` over a context of
random tokens, the attention its backend runs (native in reduced precision, fused in float32).

Trees are random (every node's parent drawn among the earlier ones), one per size; times are medians
of ``--reps`` calls (``--round-reps`` rounds), the sizes and ways interleaved within each repetition
so that drift falls on all of them alike. Each cell is ms and, in brackets, the ratio to the same
way's one-token call.
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
import torch.nn.functional as F  # noqa: E402

from racer.bench.tiny import random_tree  # noqa: E402
from verifier import llama, native  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def _row(label: str, sizes: list[int], times: dict) -> str:
    one = statistics.median(times[sizes[0]])
    cells = [f"{statistics.median(times[n]):.3f} ({statistics.median(times[n]) / one:.2f}x)" for n in sizes]
    return f"| {label} | " + " | ".join(cells) + " |"


def _interleaved(calls: dict, reps: int) -> dict:
    """Medians' inputs: ms of each call, ``reps`` times after one warm-up pass, interleaved."""
    times = {key: [] for key in calls}
    for rep in range(reps + 1):
        for key, call in calls.items():
            t0 = time.perf_counter()
            call()
            if rep:
                times[key].append((time.perf_counter() - t0) * 1e3)
    return times


def _attention_calls(dtype, past: int, sizes: list[int], gathered: bool, rng: random.Random) -> dict:
    """(way, size) -> a call of one layer's attention of a random tree of that size at ``past``."""
    kv = torch.randn((2, KV_HEADS, past + max(sizes) + llama._KEY_BLOCK, DIM)).to(dtype)
    paths = (
        native.attention_paths(dtype, HEADS, KV_HEADS, DIM) if native.attention_usable(dtype, kv.device, DIM) else ()
    )
    calls = {}
    for n in sizes:
        mask, _ = random_tree(rng, past, n)
        q = torch.randn((n, HEADS, DIM)).to(dtype)
        keys = llama._row_keys(mask, past, n)
        for p in paths:
            calls[(f"native-{p}", n)] = lambda q=q, keys=keys, p=p: native.attention(q, kv, *keys, 0.125, path=p)
        add = llama._additive(mask, dtype, "cpu")
        qt = q.transpose(0, 1)[None]
        calls[("sdpa", n)] = lambda qt=qt, add=add, m=past + n: F.scaled_dot_product_attention(
            qt, kv[0, :, :m][None], kv[1, :, :m][None], attn_mask=add, scale=0.125, enable_gqa=True
        )
        if gathered:
            groups = llama._row_groups(mask, past, n, "cpu", dtype)
            calls[("gathered", n)] = lambda qt=qt, groups=groups: llama._rows_attention(qt, kv, groups, 0.125, True)
    return calls


def attention_table(dtype, contexts: list[int], sizes: list[int], reps: int, gathered: bool) -> None:
    rng = random.Random(0)
    name = str(dtype).removeprefix("torch.")
    print(
        f"\nAttention alone, one layer, {name}, {torch.get_num_threads()} threads, medians of {reps}, ms (x one token)"
    )
    if native.attention_usable(dtype, torch.device("cpu"), DIM):
        print(f"native path picked at start-up here: {native.attention_path(dtype, HEADS, KV_HEADS, DIM)}")
    print("| context, way | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for past in contexts:
        calls = _attention_calls(dtype, past, sizes, gathered, rng)
        with torch.inference_mode():
            times = _interleaved(calls, reps)
        for way in dict.fromkeys(w for w, _ in calls):
            print(_row(f"{past}, {way}", sizes, {n: times[(way, n)] for n in sizes}))


def round_table(model_name: str, dtype, contexts: list[int], sizes: list[int], reps: int) -> None:
    from verifier.engine import VerifierSession
    from verifier.model import load

    name = str(dtype).removeprefix("torch.")
    model = load(model_name, dtype=name, tokenizer=False).model
    vocab = model.config.vocab_size
    rng = random.Random(1)
    sessions = {}
    for past in contexts:
        s = VerifierSession(model)
        s.prefill([rng.randrange(vocab) for _ in range(past)])
        sessions[past] = s
    b = next(iter(sessions.values())).backend
    way = "native" if b.native_attention else "fused SDPA"
    print(f"\nA whole round (verify: forward, logits, acceptance), {name}, {way} attention, {b.plan.describe()}")
    print(f"{torch.get_num_threads()} threads, random trees, medians of {reps}, ms (x one token)")
    print("| context | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    trees = {n: ([rng.randrange(vocab) for _ in range(n)], random_tree(rng, 0, n)[1]) for n in sizes}

    def verify(past, n):
        sessions[past].verify(*trees[n])
        sessions[past].truncate(past)

    for past in contexts:
        times = _interleaved({n: lambda past=past, n=n: verify(past, n) for n in sizes}, reps)
        print(_row(str(past), sizes, times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--contexts", default="256,800,2000")
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--round-reps", type=int, default=5, help="0: no whole rounds")
    ap.add_argument("--model", default="default")
    ap.add_argument("--gathered", action="store_true", help="also the gathered rows (slow at 64 nodes)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(n) for n in args.sizes.split(",")]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, {torch.get_num_threads()} threads")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        attention_table(dtype, contexts, sizes, args.reps, args.gathered)
        if args.round_reps:
            round_table(args.model, dtype, contexts, sizes, args.round_reps)


if __name__ == "__main__":
    main()
