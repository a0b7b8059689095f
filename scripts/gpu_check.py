"""The checks ``scripts/gpu_check.sh`` runs on a device, as one table.

    PYTHONPATH=. python scripts/gpu_check.py --device cuda            # on a machine with a GPU
    PYTHONPATH=. python scripts/gpu_check.py --device cpu --smoke     # the same code paths, tiny sizes

1. Lossless on the device: a small random Llama with 64-wide heads, in float16 and bfloat16, every
   drafting mode and budget against ``off`` token for token; in float32, tree-node logits against
   Hugging Face's own forward over each node's path.
2. ``racer bench`` on the default model (first prompt of each Spec-Bench category) in float16,
   bfloat16 (racer must equal off) and float32 (racer must equal HF greedy). Not with ``--smoke``.
3. The verifier's cost curve (tree sizes 1-64) of a random-weight ~1B Llama (TinyLlama's shape) in
   the device's reduced precision, at 256 and 2,000 tokens of context.

Prints one markdown table (and ``--json`` writes the same rows). Exits 1 when a lossless check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from common.loop import generate
from common.params import MODES, GenerationParams
from drafter.draft_session import DraftSession
from verifier.engine import VerifierSession, measure_cost

VOCAB = 96


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions, so greedy paths are not near-ties
        model.model.embed_tokens.weight.mul_(30.0)
        model.lm_head.weight.mul_(8.0)
    return model


def _generate(model, prompt, mode, budget, n):
    v = VerifierSession(model, backend="llama")
    params = GenerationParams(max_new_tokens=n, mode=mode, budget=budget)
    return [t for c in generate(DraftSession(), v, prompt, params) for t in c]


def lossless_rows(device: str, smoke: bool) -> list[dict]:
    rows = []
    rng = random.Random(0)
    n, seeds = (16, 1) if smoke else (48, 2)
    for dtype in ("float16", "bfloat16"):
        model = _llama(256, 2, 4, 2, 512, VOCAB).to(device=device, dtype=getattr(torch, dtype))
        same = total = 0
        for seed in range(seeds):
            prompt = [rng.randrange(3, VOCAB) for _ in range(30 + 40 * seed)]
            off = _generate(model, prompt, "off", 1, n)
            for mode in MODES:
                for budget in (4, 64):
                    total += 1
                    same += _generate(model, prompt, mode, budget, n) == off
        rows.append(
            {"check": f"every mode and budget equals off, {dtype}", "result": f"{same}/{total}", "ok": same == total}
        )
    model = _llama(256, 2, 4, 2, 512, VOCAB).to(device=device)
    prompt = [rng.randrange(3, VOCAB) for _ in range(60)]
    tokens = [rng.randrange(3, VOCAB) for _ in range(16)]
    parents = [-1] + [rng.randrange(i) for i in range(1, 16)]
    s = VerifierSession(model, backend="llama")
    s.prefill(prompt)
    ids, positions, mask = s._inputs(tokens, parents)
    with torch.inference_mode():
        tree = s.backend.logits(s.backend.forward(ids, positions, mask)).float()
        worst = 0.0
        for i in range(16):
            path, j = [], i
            while j >= 0:
                path.append(tokens[j])
                j = parents[j]
            ref = model(torch.tensor([prompt + path[::-1]], device=device)).logits[0, -1].float()
            worst = max(worst, (tree[i] - ref).abs().max().item())
    rows.append(
        {"check": "float32 tree logits vs HF forward, max abs diff", "result": f"{worst:.2e}", "ok": worst < 1e-3}
    )
    return rows


def bench_rows(device: str, tokens: int) -> list[dict]:
    from racer.bench import modes as bench
    from racer.inprocess import InProcessStack
    from racer.prompts import DEFAULT_PROMPTS, load_spec_bench
    from verifier.model import load
    from verifier.prior import find_or_compute

    prompts = load_spec_bench(DEFAULT_PROMPTS, 1)
    rows = []
    for dtype in ("float16", "bfloat16", "float32"):
        loaded = load("default", dtype=dtype)
        loaded.model.to(device)
        prior = find_or_compute(load("default", dtype="float32", tokenizer=False).model, loaded.tokenizer, 8)
        engine = InProcessStack(loaded, prior=prior)
        engine.tune_kernels()
        records = bench.run(engine, prompts, ["greedy", "off", "racer"], [0, 16, 64], tokens, None, progress=False)
        for r in bench.summarize(records):
            if r["category"] != "overall":
                continue
            key = "lossless" if dtype != "float32" else "equals_hf"
            rows.append(
                {
                    "check": f"bench {dtype} {r['mode']} {bench.budget_name(r['budget'])}",
                    "result": f"{r['tok_s']:.1f} tok/s, {r['speedup']:.2f}x HF, MAT {r['mat']:.2f}, "
                    f"{'= ' + bench.reference_mode(engine)} {r[key]}",
                    "ok": r[key].split("/")[0] == r[key].split("/")[1],
                }
            )
        del engine, loaded
    return rows


def cost_rows(device: str, smoke: bool) -> list[dict]:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if smoke:
        model, contexts, sizes = _llama(256, 2, 4, 2, 512, 1000), (64, 300), (1, 4, 16, 64)
    else:  # TinyLlama-1.1B's shape, random weights
        model, contexts, sizes = _llama(2048, 22, 32, 4, 5632, 32000), (256, 2000), (1, 2, 4, 8, 16, 32, 64)
    model = model.to(device=device, dtype=dtype)
    rows = []
    for ctx in contexts:
        costs = measure_cost(model, sizes=sizes, context=ctx, reps=3 if smoke else 5)
        cells = ", ".join(f"{n}: {ms:.1f}" for n, ms in costs.items())
        rows.append({"check": f"cost curve ms, {str(dtype)[6:]}, context {ctx}", "result": cells, "ok": True})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and no default-model bench (a CPU check)")
    ap.add_argument("--bench-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    rows = lossless_rows(args.device, args.smoke)
    if not args.smoke:
        rows += bench_rows(args.device, args.bench_tokens)
    rows += cost_rows(args.device, args.smoke)
    print(f"\n{name}, torch {torch.__version__}, {time.perf_counter() - t0:.0f} s\n")
    print("| check | result | ok |\n|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['result']} | {'yes' if r['ok'] else 'NO'} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
