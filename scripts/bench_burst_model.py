"""A burst of new sessions on the verifier's core alone: where their time to first token goes.

``--sessions`` prompts open at once on one ``Verifier`` (the default model, float32 unless
``--dtype`` says otherwise), while the sessions already prefilled run rounds of ``--tree`` nodes
(a chain: the target's last choice and random guesses, so each round accepts the bonus token), as
many as ``--rounds``. No gateway, drafter or network: what is left is the model thread's schedule.
Per configuration (prefills batched or one at a time) and per burst: time to first token (when the
forward that prefilled the prompt returned, on the model thread) p50/p99, in wall seconds and in the
model thread's CPU seconds (its own clock, which other processes on a shared machine do not
advance), and the most prompt jobs a round waited behind. Configurations alternate within each repetition; medians.

The script uses only what ``Verifier`` offers, so the same command measures an older tree too:

    PYTHONPATH=. python scripts/bench_burst_model.py [--sessions 32] [--rounds 12] [--tree 8]
        [--threads 1] [--reps 3] [--lead 2048] [--shared 24]

``--shared N``: every prompt begins with the same N tokens (at most the shortest prompt's length),
as chat requests begin with their template and system prompt (24 tokens for the default model's).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scripts.bench_prompts import common_head_length, prompts_with_common_head  # noqa: E402
from verifier import batcher  # noqa: E402
from verifier.model import load  # noqa: E402
from verifier.sessions import Open, Verifier  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class ModelClock:
    """The model thread's CPU seconds, read at each job's end (on that thread), and when each
    session's prefill came out of its forward (``prefilled``: session -> (CPU s, wall s))."""

    def __init__(self, v: Verifier):
        self.cpu = 0.0
        self.prefilled: dict[object, tuple[float, float]] = {}
        self.round_waits: list[int] = []  # prompt jobs started while each round waited (events)
        self._waiting: dict[int, int] = {}
        self._lock = threading.Lock()
        v.model_thread.hooks.append(self)

    def __call__(self, event, job):
        with self._lock:
            if event == "queued" and job.kind == "verify":
                self._waiting[id(job)] = 0
            elif event == "start" and job.kind == "prefill":
                for k in self._waiting:
                    self._waiting[k] += 1
            elif event == "start" and job.kind == "verify":
                self.round_waits.append(self._waiting.pop(id(job), 0))
            elif event == "done":
                self.cpu = time.thread_time()


def _clocked_prefill_batch(clocks: list[ModelClock]):
    """``batcher.prefill_batch``, noting on the model thread when each session's prompt is done."""
    real = batcher.prefill_batch

    def prefill_batch(items):
        out = real(items)
        now = (time.thread_time(), time.perf_counter())
        for clock in clocks:
            for session, *_ in items:
                clock.prefilled[session] = now
        return out

    return prefill_batch


async def burst(v: Verifier, clock: ModelClock, prompts, rounds: int, tree: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = v.vocab_size
    t0, c0 = time.perf_counter(), clock.cpu
    wall: list[float] = []
    cpu: list[float] = []

    async def one(i: int, p: list[int]) -> None:
        e = v.claim(Open("t", f"s{seed}-{i}", p))
        try:
            r = (await v.open(e, p, reserve_tokens=rounds * tree)).next_token
            done_cpu, done_wall = clock.prefilled.pop(e.session)
            wall.append(done_wall - t0)
            cpu.append(done_cpu - c0)
            for _ in range(rounds):
                tokens = [r] + [rng.randrange(vocab) for _ in range(tree - 1)]
                r = (await v.verify(e, tokens, [-1, *range(tree - 1)])).next_token
        finally:
            v.release(e)
            v.drop(e.tenant, e.session_id)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return dict(wall=wall, cpu=cpu, total=time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--prompt-tokens", default="24-48", help="each prompt's length, drawn from this range")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tree", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lead", type=int, default=None, help="--prefill-lead (where the tree has it)")
    ap.add_argument("--shared", type=int, default=0, help="leading tokens every prompt has in common")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load(args.model, args.dtype, args.threads, False).model
    lo, hi = map(int, args.prompt_tokens.split("-"))
    rng = random.Random(0)
    lengths = [rng.randint(lo, hi) for _ in range(args.sessions)]
    prompts = prompts_with_common_head(rng, model.config.vocab_size, lengths, args.shared)
    shared = common_head_length(args.shared, lengths)
    params = inspect.signature(Verifier).parameters
    extra = {"kv_memory_bytes" if "kv_memory_bytes" in params else "kv_budget_bytes": 1 << 30}
    if args.lead is not None and "prefill_lead" in params:
        extra["prefill_lead"] = args.lead
    configs = {"batched": 16, "one at a time": 1}
    rows: dict[str, list[dict]] = {n: [] for n in configs}
    waits: dict[str, list[int]] = {n: [] for n in configs}

    async def run():
        vs = {n: Verifier(model, prefill_batch=b, **extra) for n, b in configs.items()}
        clocks = {n: ModelClock(v) for n, v in vs.items()}
        batcher.prefill_batch = _clocked_prefill_batch(list(clocks.values()))  # bursts run one at a time
        for rep in range(args.reps + 1):  # the first pass warms up and is not counted
            for n in list(configs) if rep % 2 == 0 else list(configs)[::-1]:
                r = await burst(vs[n], clocks[n], prompts, args.rounds, args.tree, rep)
                if rep:
                    rows[n].append(r)
        for n, v in vs.items():
            waits[n] = clocks[n].round_waits
            v.close()

    asyncio.run(run())
    med = statistics.median
    print(
        f"{args.sessions} sessions ({args.prompt_tokens} prompt tokens) open at once, rounds of {args.tree} nodes "
        f"x {args.rounds}; {args.dtype}, {torch.get_num_threads()} thread(s); medians over {args.reps} bursts; "
        f"{shared} leading tokens in common"
        + (f"; prefill_lead={extra['prefill_lead']}" if "prefill_lead" in extra else "")
    )
    print(
        "| prefill | TTFT p50 s | TTFT p99 s | TTFT p50 model-CPU s | TTFT p99 model-CPU s | burst s "
        "| prompt jobs a round waited behind, max |"
    )
    print("|---|---|---|---|---|---|---|")
    p99: dict[str, float] = {}
    for n, rs in rows.items():
        p99[n] = med(percentile(r["cpu"], 0.99) for r in rs)
        wall50, wall99 = (med(percentile(r["wall"], q) for r in rs) for q in (0.5, 0.99))
        cpu50 = med(percentile(r["cpu"], 0.5) for r in rs)
        print(
            f"| {n} | {wall50:.2f} | {wall99:.2f} | {cpu50:.2f} | {p99[n]:.2f} | {med(r['total'] for r in rs):.2f} "
            f"| {max(waits[n], default=0)} |"
        )
    print(f"TTFT p99 (model CPU), batched / one at a time: {p99['batched'] / p99['one at a time']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
