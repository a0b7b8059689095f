"""``racer bench-burst``: a burst of concurrent streaming chat requests through the OpenAI API of a
local stack, with the verifier prefilling waiting prompts together and one at a time, in one run.

Two stacks run side by side (``RACER_PREFILL_BATCH`` 16 and 1, everything else the same); the burst
is sent to each in turn, alternating which goes first, with the official ``openai`` client and its
defaults (two retries, honouring ``Retry-After``). Per burst: requests answered, time to first
content token (p50/p99), aggregate completion tokens/s, and whether each answer equals the other
configuration's answer to the same prompt. Medians over the repetitions are printed as a table.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
from types import SimpleNamespace

from ..stats import percentile
from .harness import table

CONFIGS = {"batched": {"RACER_PREFILL_BATCH": "16"}, "one at a time": {"RACER_PREFILL_BATCH": "1"}}


async def burst(base_url: str, model: str, prompts: list[str], max_tokens: int, api_key: str = "none") -> dict:
    """Every prompt at once as a streaming chat request; what came back."""
    import openai

    texts: dict[int, str] = {}
    ttft: list[float] = []
    errors: list[str] = []
    tokens = 0

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client:  # the client's defaults

        async def one(i: int) -> None:
            nonlocal tokens
            t0 = time.perf_counter()
            first = None
            parts = []
            try:
                stream = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompts[i]}],
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        if first is None:
                            first = time.perf_counter() - t0
                        parts.append(chunk.choices[0].delta.content)
                texts[i] = "".join(parts)
                if first is not None:
                    ttft.append(first)
            except openai.APIError as e:
                errors.append(f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    return dict(texts=texts, ttft=ttft, errors=errors, tokens=tokens, wall=wall)


def _burst_table(rows: dict[str, list[dict]], prompts: list[str], args) -> str:
    names = list(rows)
    reference = rows[names[1]][0]["texts"]  # one prompt per forward: what the verifier did before
    lines = [
        f"{len(prompts)} concurrent streaming chat requests, greedy, max_tokens={args.max_new_tokens}, "
        f"openai client defaults; medians over {args.reps} burst(s) each, interleaved",
    ]
    head = ("prefill", "answered", "TTFT p50 s", "TTFT p99 s", "aggregate tok/s", "same answer as one at a time")
    cells = []
    med = statistics.median
    p99 = {}
    for name in names:
        runs = rows[name]
        p99[name] = med(percentile(r["ttft"], 0.99) if r["ttft"] else float("nan") for r in runs)
        same = sum(1 for r in runs for i, t in r["texts"].items() if reference.get(i) == t)
        cells.append(
            (
                name,
                f"{med(len(r['texts']) for r in runs):.0f}/{len(prompts)}",
                f"{med(percentile(r['ttft'], 0.5) if r['ttft'] else float('nan') for r in runs):.2f}",
                f"{p99[name]:.2f}",
                f"{med(r['tokens'] / r['wall'] for r in runs):.1f}",
                f"{same}/{sum(len(r['texts']) for r in runs)}",
            )
        )
    lines.append(table(head, cells))
    lines.append(f"TTFT p99, batched / one at a time: {p99[names[0]] / p99[names[1]]:.2f}")
    return "\n".join(lines)


def bench_burst(args) -> int:
    from .. import stack
    from ..launch import served_model_name
    from .loadgen import make_prompts

    try:
        import openai  # noqa: F401 - the client the burst goes through
    except ImportError:
        print("racer bench-burst needs the openai client: pip install openai", file=sys.stderr)
        return 2
    prompts = [p[0] for p in make_prompts(args.requests, 1, args.seed)]
    model = served_model_name(SimpleNamespace(served_model_name="", model=args.model))
    names = list(CONFIGS)
    rows: dict[str, list[dict]] = {n: [] for n in names}
    urls = {name: f"http://127.0.0.1:{args.http_port + i}/v1" for i, name in enumerate(names)}
    with contextlib.ExitStack() as stacks:
        for i, name in enumerate(names):  # the second stack 10 ports up, its HTTP API on the next port
            stacks.enter_context(
                stack.running(
                    args.model,
                    args.port_base + 10 * i,
                    args.metrics_base + 10 * i,
                    env=CONFIGS[name],
                    pin=args.pin,
                    http_port=args.http_port + i,
                )
            )
        for rep in range(args.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                r = asyncio.run(burst(urls[name], model, prompts, args.max_new_tokens, stack.client_key() or "none"))
                rows[name].append(r)
                print(
                    f"{name}: {len(r['texts'])}/{len(prompts)} answered, TTFT p99 "
                    f"{percentile(r['ttft'], 0.99) if r['ttft'] else float('nan'):.2f} s, "
                    f"{r['tokens'] / r['wall']:.1f} tok/s, errors {len(r['errors'])}",
                    file=sys.stderr,
                )
                for e in r["errors"][:3]:
                    print(f"  {e}", file=sys.stderr)
    print(_burst_table(rows, prompts, args))
    return 0
