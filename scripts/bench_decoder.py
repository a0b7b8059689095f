"""The native decoder against the same layers op by op, for a family's shape: one verification of a
chain of 1, 4 and 16 nodes over a cache of ``--context`` tokens, bfloat16 random weights (built here,
nothing is downloaded), the two ways alternated, medians of ``--reps`` after a warm-up.

    PYTHONPATH=. python scripts/bench_decoder.py [--shape gemma2|phi3-partial] [--threads 2] [--tile native4x3]

``--tile`` forces a widening native tile (as the decoder tests do) where the tuner would store a
fused weight as panels, whose row ranges the native decoder does not take.
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

SHAPES = {
    # soft-capped attention scores, sandwich norms, local and global layers (a Gemma-3-270M-like size)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            vocab_size=32000, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        ),
    ),
    # fused q/k/v and gate/up weights, rotary over three quarters of each head (a Phi-4-mini-like factor)
    "phi3-partial": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
            num_attention_heads=16, num_key_value_heads=4, partial_rotary_factor=0.75,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        ),
    ),
}  # fmt: skip
SIZES = (1, 4, 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two ways")
    ap.add_argument("--tile", default="", help="RACER_KERNELS for both ways (default: the tuner's)")
    args = ap.parse_args()
    if args.tile:
        import os

        os.environ["RACER_KERNELS"] = args.tile
    import transformers

    from verifier import llama
    from verifier.engine import VerifierSession

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config_cls, model_cls, kw = SHAPES[args.shape]
    cfg = getattr(transformers, config_cls)(max_position_embeddings=4096, **kw)
    model = getattr(transformers, model_cls)(cfg).eval().to(torch.bfloat16)
    rng = random.Random(0)
    natively = llama._attends_natively

    def run(fused: bool) -> dict[int, float]:
        llama._DECODERS.clear()
        llama._attends_natively = natively if fused else (lambda b: False)  # op by op: no native decoder
        s = VerifierSession(model, 8, "llama")
        s.prefill([rng.randrange(cfg.vocab_size) for _ in range(args.context)])
        if (s.backend.fused is not None) != fused:
            raise SystemExit(f"the native decoder does not take this shape here ({args.shape}); try --tile")
        out = {}
        for n in SIZES:
            parents, times = [-1, *range(n - 1)], []
            for rep in range(args.reps + 1):
                tokens = [rng.randrange(cfg.vocab_size) for _ in parents]
                t0 = time.perf_counter()
                s.verify(tokens, parents)
                if rep:  # the first pays for warm-up
                    times.append((time.perf_counter() - t0) * 1e3)
                s.truncate(args.context)
            out[n] = statistics.median(times)
        return out

    rows = {False: [], True: []}
    for _ in range(args.rounds):
        for fused in (False, True):
            rows[fused].append(run(fused))
    llama._attends_natively = natively
    print(
        f"{args.shape}, bfloat16, {args.threads} threads, {args.context} tokens of context, chain trees, "
        f"medians of {args.reps} (ms), {args.rounds} alternations"
    )
    print("| way | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in SIZES) + " |")
    print("|---|" + "---|" * len(SIZES))
    for fused, label in ((False, "op by op"), (True, "native decoder")):
        cells = [" / ".join(f"{r[n]:.1f}" for r in rows[fused]) for n in SIZES]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
