"""The tenant corpus at scale: bytes per token, indexing time, and drafter step time with it.

Fills a corpus with real text (the Spec-Bench questions, tokenized with the default model's
tokenizer, repeated until ``--tokens``: repetition is the worst case for a lookup, every key has a
long chain) and times, interleaved, a full draft step (``DraftSession.draft``: automaton, corpus,
copy-logit tree) with and without the corpus, from contexts cut out of the same text (so that the
corpus always matches). Prints one table. With ``--store redis://...``, also publishes the same
tokens to a tenant stream in 64-token records and times a drafter replica loading it (read and
index, ``drafter.corpora``).

    PYTHONPATH=. python scripts/bench_corpus.py --tokens 1000000 --steps 2000 --budget 64 \
        --store redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import numpy as np

from drafter.corpus import Corpus, CorpusConfig
from drafter.draft_session import DrafterConfig, DraftSession
from racer.prompts import DEFAULT_PROMPTS
from racer.stats import percentile


def texts(path) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                turns = json.loads(line)["turns"]
                out.extend(turns if isinstance(turns, list) else [turns])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--store", default="", help="redis://... : also time loading the corpus from a tenant stream")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from verifier.model import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir()))
    docs = [tok.encode(t, add_special_tokens=False) for t in texts(args.prompts)]
    docs = [d for d in docs if len(d) >= 32]
    corpus = Corpus(CorpusConfig(max_tokens=args.tokens))
    t0 = time.perf_counter()
    added, i = 0, 0
    while added < args.tokens:
        d = docs[i % len(docs)]
        corpus.add(d)
        added += len(d)
        i += 1
    index_s = time.perf_counter() - t0
    # streamed in chunks of 4 tokens, as a response is added round by round
    stream = Corpus(CorpusConfig(max_tokens=1 << 16))
    w = stream.writer()
    sample = [t for d in docs[:200] for t in d][: 1 << 16]
    t0 = time.perf_counter()
    for j in range(0, len(sample), 4):
        stream.append(w, sample[j : j + 4])
    chunk_us = (time.perf_counter() - t0) / (len(sample) / 4) * 1e6

    rng = random.Random(0)
    cfg = DrafterConfig()
    times = {"without corpus": [], "with corpus": []}
    corpus_nodes = []
    for _ in range(args.steps):
        d = docs[rng.randrange(len(docs))]
        cut = rng.randrange(16, len(d) - 1)
        ctx, root = d[max(0, cut - 512) : cut], d[cut]
        rows = np.random.default_rng(cut).integers(0, 49152, size=(len(ctx), cfg.topk)).tolist()
        plain, shared = DraftSession(cfg), DraftSession(cfg)
        shared.corpus = corpus
        for s in (plain, shared):
            s.extend(ctx, rows)
        for name, s in (("without corpus", plain), ("with corpus", shared)):
            t = time.perf_counter()
            tree = s.draft(root, args.budget)
            times[name].append((time.perf_counter() - t) * 1e3)
            if name == "with corpus":
                corpus_nodes.append(len(tree.corpus_nodes))
    print(
        f"corpus: {len(corpus):,} tokens in {corpus.responses:,} responses, {corpus.nbytes():,} bytes "
        f"({corpus.nbytes() / len(corpus):.1f} B/token), indexed in {index_s:.2f} s "
        f"({index_s / len(corpus) * 1e6:.2f} us/token); streamed 4-token chunks: {chunk_us:.1f} us each"
    )
    if args.store:
        print(asyncio.run(load_time(args.store, docs, args.tokens)))
    print(f"draft step, budget {args.budget}, {args.steps} steps interleaved (ms):")
    print("| | p50 | p99 | max | corpus nodes (median) |")
    print("|---|---|---|---|---|")
    for name, xs in times.items():
        nodes = statistics.median(corpus_nodes) if name == "with corpus" else 0
        print(f"| {name} | {percentile(xs, 0.5):.3f} | {percentile(xs, 0.99):.3f} | {max(xs):.3f} | {nodes:g} |")


async def load_time(url: str, docs, tokens: int, chunk: int = 64) -> str:
    from common.store import open_store
    from drafter.corpora import Corpora, encode, epoch_key, stream_key

    store = open_store(url)
    tenant = "bench-corpus-load"
    await store.xdelete(stream_key(tenant))
    await store.delete(epoch_key(tenant))
    t0 = time.perf_counter()
    added, i, n = 0, 0, 0
    while added < tokens:
        d = docs[i % len(docs)]
        i += 1
        for j in range(0, len(d), chunk):
            await store.xadd(stream_key(tenant), encode(0, 1, i, d[j : j + chunk]), tokens, 3600.0)
            n += 1
        added += len(d)
    write_s = time.perf_counter() - t0
    corpora = Corpora(tokens, store=store)
    t0 = time.perf_counter()
    await corpora.open(tenant, share=False)
    await corpora.tenants[tenant].loading
    load_s = time.perf_counter() - t0
    held = len(corpora.current(tenant))
    await store.xdelete(stream_key(tenant))
    await store.close()
    return (
        f"store: {n:,} records ({added:,} tokens) written in {write_s:.1f} s; a replica loaded them "
        f"({held:,} tokens) in {load_s:.2f} s (read + decode + index, in a worker thread)"
    )


if __name__ == "__main__":
    main()
