"""``racer bench-corpus``: fresh sessions one after another, with the tenant corpus on and off.

Every session is fresh (a new drafter session and verifier cache) and runs one prompt. With the
corpus on, every session of the tenant drafts from one ``Corpus`` and its response is added to it
as it streams (round by round, as the drafter service does); with it off, the same sessions draft
from their own context only. On and off run interleaved, prompt by prompt, so a noisy machine
slows both alike; each budget has a corpus of its own. Greedy decoding, so the outputs must be
identical with the corpus on and off: the command checks it (and, with ``--hf``, against Hugging
Face greedy decoding too).

Two runs:
- ``category``: per Spec-Bench category, one tenant, ``--sessions`` prompts of that category;
- ``repeat``: ``--sessions`` prompts (round robin over the categories) answered once, then asked
  again by new sessions of the same tenant (pass 1, pass 2). With ``--through stack`` it runs again
  through real services with ``--drafters`` replicas, the sessions alternating between them
  (``corpus_stack.py``), and the two gains are compared.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from common.loop import Stats
from common.text import prompt_ids
from drafter.corpus import Corpus, CorpusConfig

from ..inprocess import InProcessStack
from ..prompts import Prompt
from .harness import table


@dataclass
class Result:
    group: str  # category, or pass 1 / pass 2
    question_id: str
    corpus: bool
    budget: int
    output: list[int]
    rounds: int
    seconds: float
    drafted: dict
    accepted: dict
    identical: bool | None = None  # to the output with the corpus off
    equals_hf: bool | None = None

    @property
    def tokens(self) -> int:
        return len(self.output)


def run_one(engine: InProcessStack, ids: list[int], budget: int, max_new_tokens: int, corpus: Corpus | None) -> tuple:
    drafter = engine.new_drafter()
    drafter.corpus = corpus
    writer = corpus.writer() if corpus is not None else None
    stats = Stats()
    params = engine.default_params(max_new_tokens=max_new_tokens, mode="racer", budget=budget)
    out: list[int] = []
    t = time.perf_counter()
    for chunk in engine.stream(ids, params, stats=stats, drafter=drafter):
        out.extend(chunk)
        if writer is not None:
            corpus.append(writer, chunk)
    return out, stats.rounds, time.perf_counter() - t, dict(drafter.drafted), dict(drafter.accepted)


def run_sessions(
    engine: InProcessStack,
    groups: list[tuple[str, list[Prompt]]],
    budgets: list[int],
    max_new_tokens: int,
    system: str | None,
    corpus_tokens: int,
    hf: bool = False,
    fresh_corpus_per_group: bool = True,
    progress: bool = True,
) -> list[Result]:
    """Each group's prompts in order, every budget with the corpus off then on, prompt by prompt.
    ``fresh_corpus_per_group``: a new tenant (an empty corpus) per group; else one for all groups."""
    from tqdm import tqdm

    from .modes import run_hf

    results: list[Result] = []
    total = sum(len(ps) for _, ps in groups) * len(budgets) * 2
    bar = tqdm(total=total, disable=not progress, file=sys.stderr, unit="session")
    warm = prompt_ids(engine.tokenizer, "Hello", system)
    run_one(engine, warm, max(budgets), 4, None)
    corpora = {b: Corpus(CorpusConfig(max_tokens=corpus_tokens)) for b in budgets}
    for name, prompts in groups:
        if fresh_corpus_per_group:
            corpora = {b: Corpus(CorpusConfig(max_tokens=corpus_tokens)) for b in budgets}
        for p in prompts:
            ids = prompt_ids(engine.tokenizer, p.text, system)
            ref = run_hf(engine, ids, max_new_tokens)[0] if hf else None
            for b in budgets:
                off = None
                for use in (False, True):
                    bar.set_description(f"{name[:14]} C={b} corpus {'on' if use else 'off'}")
                    out, rounds, secs, drafted, accepted = run_one(
                        engine, ids, b, max_new_tokens, corpora[b] if use else None
                    )
                    r = Result(name, p.question_id, use, b, out, rounds, secs, drafted, accepted)
                    if use:
                        r.identical = out == off.output
                        off.identical = r.identical
                    else:
                        off = r
                    if ref is not None:
                        r.equals_hf = out == ref
                    results.append(r)
                    bar.update()
    bar.close()
    return results


def summarize(results: list[Result]) -> list[dict]:
    """One row per group (and 'overall') x budget, the corpus off and on side by side."""
    rows = []
    groups = list(dict.fromkeys(r.group for r in results)) + ["overall"]
    budgets = list(dict.fromkeys(r.budget for r in results))
    for g in groups:
        for b in budgets:
            row = dict(group=g, budget=b)
            for use in (False, True):
                rs = [r for r in results if r.budget == b and r.corpus == use and g in (r.group, "overall")]
                if not rs:
                    continue
                tokens = sum(r.tokens for r in rs)
                rounds = sum(r.rounds for r in rs)
                key = "on" if use else "off"
                row[f"mat_{key}"] = tokens / rounds if rounds else 0.0
                row[f"tok_s_{key}"] = tokens / sum(r.seconds for r in rs)
                row["sessions"] = len(rs)
                row["identical"] = f"{sum(1 for r in rs if r.identical)}/{len(rs)}"
                if any(r.equals_hf is not None for r in rs):
                    row[f"hf_{key}"] = f"{sum(1 for r in rs if r.equals_hf)}/{len(rs)}"
                if use:
                    row["corpus_drafted"] = sum(r.drafted["corpus"] for r in rs)
                    row["corpus_accepted"] = sum(r.accepted["corpus"] for r in rs)
            if "mat_on" in row:
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    hf = any("hf_on" in r for r in rows)
    head = ["group", "C", "n", "MAT off", "MAT on", "on/off", "tok/s off", "tok/s on", "on/off tok/s"]
    head += ["corpus nodes", "accepted", "identical"] + (["= HF off", "= HF on"] if hf else [])
    lines = []
    for r in rows:
        cells = [
            r["group"],
            str(r["budget"]),
            str(r["sessions"]),
            f"{r['mat_off']:.2f}",
            f"{r['mat_on']:.2f}",
            f"{r['mat_on'] / r['mat_off']:.2f}",
            f"{r['tok_s_off']:.1f}",
            f"{r['tok_s_on']:.1f}",
            f"{r['tok_s_on'] / r['tok_s_off']:.2f}",
            str(r["corpus_drafted"]),
            str(r["corpus_accepted"]),
            r["identical"],
        ]
        if hf:
            cells += [r.get("hf_off", "-"), r.get("hf_on", "-")]
        lines.append(cells)
    return table(head, lines)


def repeat_groups(prompts: list[Prompt]) -> list[tuple[str, list[Prompt]]]:
    return [("pass 1", prompts), ("pass 2", prompts)]


def round_robin(by_category: dict[str, list[Prompt]], n: int) -> list[Prompt]:
    out: list[Prompt] = []
    i = 0
    while len(out) < n and any(len(ps) > i for ps in by_category.values()):
        out += [ps[i] for ps in by_category.values() if len(ps) > i][: n - len(out)]
        i += 1
    return out


def _by_category(prompts: list[Prompt], categories: list[str] | None) -> dict[str, list[Prompt]]:
    """The prompts by Spec-Bench category; only ``categories`` when named."""
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    if categories:
        unknown = set(categories) - set(by_category)
        if unknown:
            raise ValueError(f"--categories: unknown {sorted(unknown)}; have {sorted(by_category)}")
        by_category = {c: by_category[c] for c in categories}
    return by_category


def _write_json(path: str, results: list[Result]) -> None:
    """One JSON line per session, in run order, without the output tokens."""
    with open(path, "w") as f:
        for i, r in enumerate(results):
            rec = dict(r.__dict__, tokens=r.tokens)
            del rec["output"]
            f.write(json.dumps(dict(rec, order=i)) + "\n")


def main(args, after_repeat=None) -> int:
    """``after_repeat(args, prompts, results)``: run after the repeat run (``--through stack``);
    its exit status joins this one's."""
    import torch

    from ..prompts import DEFAULT_PROMPTS, load_spec_bench

    by_category = _by_category(load_spec_bench(args.prompts or DEFAULT_PROMPTS), args.categories)
    engine = InProcessStack.load(
        args.model, backend=args.backend, prior=args.prior, threads=args.threads or None, dtype=args.dtype
    )
    print(f"torch threads: {torch.get_num_threads()}; dtype: {engine.dtype}; greedy", file=sys.stderr)
    status = 0
    for run in args.runs:
        if run == "category":
            groups = [(c, ps[: args.sessions]) for c, ps in by_category.items()]
            fresh = True
        elif run == "repeat":
            groups = repeat_groups(round_robin(by_category, args.sessions))
            fresh = False
        else:
            raise ValueError(f"--runs: unknown run {run!r}; expected category and/or repeat")
        results = run_sessions(
            engine,
            groups,
            args.budget,
            args.max_new_tokens,
            args.system or None,
            args.corpus_tokens,
            hf=args.hf,
            fresh_corpus_per_group=fresh,
        )
        rows = summarize(results)
        print(
            f"\n{run} run: {args.max_new_tokens} new tokens a session, torch threads {torch.get_num_threads()}, "
            f"{engine.dtype}, greedy; MAT and tok/s over all tokens of the group"
        )
        print(format_table(rows))
        if run == "repeat":
            for b in args.budget:
                p1 = next(r for r in rows if r["group"] == "pass 1" and r["budget"] == b)
                p2 = next(r for r in rows if r["group"] == "pass 2" and r["budget"] == b)
                print(f"C={b}: pass 2 / pass 1 MAT with the corpus: {p2['mat_on'] / p1['mat_on']:.2f}")
            if after_repeat is not None:
                status |= after_repeat(args, groups[0][1], results)
        if args.json:
            _write_json(f"{args.json}.{run}.jsonl", results)
        if not all(r.identical for r in results):
            print("outputs differ with the corpus on and off", file=sys.stderr)
            status = 1
    return status
