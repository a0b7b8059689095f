"""``racer bench``: plain greedy, HF prompt lookup and every drafting mode on the same prompts.

Runs are interleaved prompt by prompt (every mode and budget on prompt 1, then prompt 2, ...) so
that a noisy machine slows all of them alike. Each run gets a fresh session. Every mode, HF's
included, runs in the engine's dtype. "Lossless" is the exactness contract of that dtype: float32
output identical to HF greedy; reduced precision identical to the engine's own ``off`` output (and
how often it also equals HF's greedy in that dtype is counted separately).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from common.loop import Stats
from common.params import MODES
from common.text import prompt_ids

from ..inprocess import InProcessStack
from ..prompts import Prompt
from ..stats import percentile
from .reference import hf_greedy

HF_MODES = ("greedy", "hf-pld")


@dataclass
class Record:
    mode: str
    budget: int
    question_id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    rounds: int
    new_tokens: int
    seconds: float
    lossless: bool | None = None
    equals_hf: bool | None = None
    mat: float = 0.0
    draft_step_ms: list[float] = field(default_factory=list)
    drafter_bytes: int = 0


def run_hf(
    engine: InProcessStack, prompt_ids: list[int], max_new_tokens: int, lookup: int = 0
) -> tuple[list[int], float]:
    """HF greedy (``lookup``: with prompt lookup) on the model as loaded: (output, seconds)."""
    with engine.reference_model() as model:
        t = time.perf_counter()
        out = hf_greedy(
            model,
            prompt_ids,
            max_new_tokens,
            tuple(engine.loaded.eos_token_ids),
            lookup=lookup,
            pad=engine.tokenizer.pad_token_id or 0,
        )
        return out, time.perf_counter() - t


def run_engine(engine: InProcessStack, prompt_ids: list[int], mode: str, budget: int, max_new_tokens: int):
    drafter = engine.new_drafter()
    stats = Stats()
    params = engine.default_params(max_new_tokens=max_new_tokens, mode=mode, budget=budget)
    out: list[int] = []
    t = time.perf_counter()
    for chunk in engine.stream(prompt_ids, params, stats=stats, drafter=drafter):
        out.extend(chunk)
    return out, time.perf_counter() - t, stats, drafter.memory_estimate()


def _runs(engine: InProcessStack, modes: list[str], budgets: list[int]) -> list[tuple[str, int]]:
    """(mode, budget) of every run of a prompt, checked: the baselines first."""
    # ``off`` drafts nothing, so its budget is moot: it runs once per prompt (at the first budget).
    runs = [(m, 0) for m in modes if m in HF_MODES] + [
        (m, b) for m in modes if m not in HF_MODES for b in (budgets[:1] if m == "off" else budgets)
    ]
    ref_mode = reference_mode(engine)
    if ref_mode == "greedy" and not any(m == "greedy" for m, _ in runs):
        raise ValueError("--modes must include greedy: it is the baseline and the lossless reference")
    if ref_mode not in modes:
        raise ValueError(f"--modes must include {ref_mode}: in {engine.dtype} it is the lossless reference")
    return runs


def _one_run(engine: InProcessStack, p: Prompt, ids: list[int], mode: str, budget: int, max_new_tokens: int) -> Record:
    if mode in HF_MODES:
        out, secs = run_hf(engine, ids, max_new_tokens, lookup=10 if mode == "hf-pld" else 0)
        return Record(mode, 0, p.question_id, p.category, ids, out, len(out), len(out), secs, mat=1.0)
    out, secs, st, mem = run_engine(engine, ids, mode, budget, max_new_tokens)
    return Record(
        mode,
        budget,
        p.question_id,
        p.category,
        ids,
        out,
        st.rounds,
        len(out),
        secs,
        mat=st.mat,
        draft_step_ms=[s * 1e3 for s in st.draft_step_s],
        drafter_bytes=mem,
    )


def run(
    engine: InProcessStack,
    prompts: list[Prompt],
    modes: list[str],
    budgets: list[int],
    max_new_tokens: int,
    system: str | None,
    progress: bool = True,
) -> list[Record]:
    from tqdm import tqdm

    runs = _runs(engine, modes, budgets)
    ref_mode = reference_mode(engine)
    if 0 in budgets and engine.costs is None:
        costs = engine.measure_costs()
        print(
            "verifier cost curve (ms by tree size): " + ", ".join(f"{n}: {c:.1f}" for n, c in costs.items()),
            file=sys.stderr,
        )
        if engine.slope is not None:
            print(
                f"each context token beyond {engine.slope.context} adds (us by tree size): "
                + ", ".join(f"{n}: {v * 1e3:.2f}" for n, v in engine.slope.per_token.items()),
                file=sys.stderr,
            )
    records: list[Record] = []
    bar = tqdm(total=len(prompts) * len(runs), disable=not progress, file=sys.stderr, unit="run")
    # Warm-up: the first forward of a process pays for allocation and kernel selection.
    warm = prompt_ids(engine.tokenizer, "Hello", system)
    run_hf(engine, warm, 4)
    run_engine(engine, warm, "racer", max(budgets), 4)
    for p in prompts:
        ids = prompt_ids(engine.tokenizer, p.text, system)
        mine = []
        for mode, budget in runs:
            bar.set_description(f"{p.category[:12]} {mode}{'' if mode in HF_MODES else '@' + budget_name(budget)}")
            mine.append(_one_run(engine, p, ids, mode, budget, max_new_tokens))
            bar.update()
        hf = next((r.output_ids for r in mine if r.mode == "greedy"), None)  # optional outside float32
        reference = next(r.output_ids for r in mine if r.mode == ref_mode)
        for rec in mine:
            rec.lossless = rec.output_ids == reference
            rec.equals_hf = None if hf is None else rec.output_ids == hf
        records += mine
    bar.close()
    return records


def reference_mode(engine) -> str:
    """The output every mode must equal: HF greedy in float32, the engine's own ``off`` otherwise."""
    return "greedy" if engine.dtype == "float32" else "off"


def budget_name(budget: int) -> str:
    return "auto" if budget == 0 else str(budget)


def summarize(records: list[Record]) -> list[dict]:
    """One row per (category or 'overall') x (mode, budget)."""
    by_prompt = {(r.question_id, r.mode, r.budget): r for r in records}
    keys = list(dict.fromkeys((r.mode, r.budget) for r in records))
    cats = list(dict.fromkeys(r.category for r in records)) + ["overall"]
    rows = []
    for cat in cats:
        for mode, budget in keys:
            rs = [r for r in records if r.mode == mode and r.budget == budget and cat in (r.category, "overall")]
            if not rs:
                continue
            speed, speed_off = [], []
            for r in rs:
                tps = r.new_tokens / r.seconds if r.seconds else 0.0
                g = by_prompt.get((r.question_id, "greedy", 0))
                o = by_prompt.get((r.question_id, "off", r.budget)) or next(
                    (x for (q, m, _), x in by_prompt.items() if q == r.question_id and m == "off"), None
                )
                if g and g.seconds:
                    speed.append(tps / (g.new_tokens / g.seconds))
                if o and o.seconds:
                    speed_off.append(tps / (o.new_tokens / o.seconds))
            tokens = sum(r.new_tokens for r in rs)
            rounds = sum(r.rounds for r in rs)
            steps = [s for r in rs for s in r.draft_step_ms]
            rows.append(
                dict(
                    category=cat,
                    mode=mode,
                    budget=budget,
                    prompts=len(rs),
                    new_tokens=tokens,
                    rounds=rounds,
                    mat=tokens / rounds if rounds else 0.0,
                    tok_s=tokens / sum(r.seconds for r in rs),
                    speedup=statistics.median(speed) if speed else float("nan"),
                    speedup_off=statistics.median(speed_off) if speed_off else float("nan"),
                    lossless=f"{sum(1 for r in rs if r.lossless)}/{len(rs)}",
                    equals_hf=f"{sum(1 for r in rs if r.equals_hf)}/{len(rs)}",
                    step_p50_ms=percentile(steps, 0.5),
                    step_p99_ms=percentile(steps, 0.99),
                    drafter_kib=statistics.median(r.drafter_bytes for r in rs) / 1024 if steps else float("nan"),
                )
            )
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        "category",
        "mode",
        "C",
        "n",
        "tokens",
        "rounds",
        "MAT",
        "tok/s",
        "x greedy",
        "x off",
        "lossless",
        "= HF",
        "step p50 ms",
        "step p99 ms",
        "drafter KiB",
    )
    lines = []
    for r in rows:
        lines.append(
            (
                r["category"],
                r["mode"],
                "-" if r["mode"] in HF_MODES else budget_name(r["budget"]),
                str(r["prompts"]),
                str(r["new_tokens"]),
                str(r["rounds"]),
                f"{r['mat']:.2f}",
                f"{r['tok_s']:.1f}",
                f"{r['speedup']:.2f}",
                f"{r['speedup_off']:.2f}",
                r["lossless"],
                r.get("equals_hf", "-"),
                _fmt(r["step_p50_ms"], 3),
                _fmt(r["step_p99_ms"], 3),
                _fmt(r["drafter_kib"], 0),
            )
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    prev = None
    for line in lines:
        if prev is not None and line[0] != prev:
            out.append("")
        prev = line[0]
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    return "\n".join(out)


def _fmt(x: float, digits: int) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def write_json(records: list[Record], path: str) -> None:
    fields = (
        "mode",
        "budget",
        "question_id",
        "category",
        "prompt_ids",
        "output_ids",
        "rounds",
        "new_tokens",
        "seconds",
    )
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            [
                {k: asdict(r)[k] for k in fields} | {"lossless": r.lossless, "equals_hf": r.equals_hf, "mat": r.mat}
                for r in records
            ],
            f,
        )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(dict.fromkeys(r["category"] for r in rows))
    keys = [k for k in dict.fromkeys((r["mode"], r["budget"]) for r in rows) if k[0] != "greedy"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(cats) * max(1, len(keys)) / 3), 8), sharex=True)
    width = 0.8 / max(1, len(keys))
    for j, (mode, budget) in enumerate(keys):
        label = f"{mode}@{budget}" if budget else mode
        for ax, metric in zip(axes, ("speedup", "mat")):
            vals = [
                next((r[metric] for r in rows if r["category"] == c and (r["mode"], r["budget"]) == (mode, budget)), 0)
                for c in cats
            ]
            ax.bar([i + j * width for i in range(len(cats))], vals, width, label=label)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_ylabel("speedup vs HF greedy (median)")
    axes[1].set_ylabel("MAT (tokens / round)")
    axes[1].set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=20)
    axes[0].legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    """``racer bench``: the prompts through every mode and budget, a table (and JSON, a plot)."""
    from ..prompts import DEFAULT_PROMPTS, load_humaneval, load_spec_bench

    prompts = []
    if args.per_category:
        prompts += load_spec_bench(args.prompts or DEFAULT_PROMPTS, args.per_category)
    if args.humaneval:
        prompts += load_humaneval(args.humaneval)
    if not prompts:
        print("no prompts: use --per-category N and/or --humaneval N", file=sys.stderr)
        return 2
    for m in args.modes:
        if m not in HF_MODES and m not in MODES:
            print(f"unknown mode {m!r}", file=sys.stderr)
            return 2
    import torch

    engine = InProcessStack.load(
        args.model,
        backend=args.backend,
        prior=args.prior,
        threads=args.threads or None,
        dtype=args.dtype,
        logits_tree=args.logits_tree,
    )
    kernels = engine.tune_kernels()
    print(
        f"dtype: {engine.dtype} (every mode, HF's included); {kernels or 'kernels: transformers (generic backend)'}",
        file=sys.stderr,
    )
    records = run(engine, prompts, args.modes, args.budget, args.max_new_tokens, args.system or None)
    rows = summarize(records)
    print(
        f"torch threads: {torch.get_num_threads()} (every mode, HF's included); dtype: {engine.dtype}; "
        f"lossless = identical to {reference_mode(engine)} output"
    )
    if kernels:
        print(kernels)
    print(format_table(rows))
    if args.json:
        write_json(records, args.json)
    if args.plot:
        plot(rows, args.plot)
    return 0
