"""What a long shared system prompt costs the drafter, per session: with shared prefixes off and on.

A tenant's sessions (function-calling: the tools' JSON docs as the system prompt, from BFCL by
default) are opened one after another on one ``Drafter`` (the service core, no gRPC) over an
in-memory store: open (automaton build and catch-up), the snapshot written at turn end (bytes, encode
time), a restore of that snapshot on a fresh replica (which rebuilds the shared prefix from the
history once, then finds it in memory), and the session's memory estimate. The top-k rows an open
carries are the shipped copy-logit prior's rows (the same size and shape as the verifier's: the
drafter's work does not depend on their values).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_drafter_prefix.py [--input FILE] [--sessions 8]

Prints one table: the median over the tenant's later sessions (the first one builds what they share),
shared prefixes off and on, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.priors import load_prior  # noqa: E402
from common.store import MemoryStore  # noqa: E402
from common.text import messages_ids  # noqa: E402
from drafter.core import Drafter, Open  # noqa: E402
from drafter.draft_session import DrafterConfig  # noqa: E402
from drafter.prefixes import SharedPrefixes  # noqa: E402
from drafter.snapshot import dumps  # noqa: E402
from racer.cli import _DEFAULT_BFCL  # noqa: E402
from racer.tool_sessions import by_tenant, load  # noqa: E402


def tokenizer(model: str):
    from transformers import AutoTokenizer

    from verifier.model import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def drafter(min_tokens: int, prior) -> Drafter:
    cfg = DrafterConfig()
    return Drafter(
        cfg, MemoryStore(), prior, max_bytes=1 << 30, prefixes=SharedPrefixes(cfg.window, cfg.topk, min_tokens)
    )


async def measure(prompts: list[list[int]], min_tokens: int, prior, tenant: str = "t") -> list[dict]:
    d = drafter(min_tokens, prior)
    other = drafter(min_tokens, prior)  # the replica a failover moves each session to
    k = d.config.topk
    rows_of = [[int(x) for x in prior[t][:k]] for t in range(prior.shape[0])]
    out = []
    for i, ids in enumerate(prompts):
        topk = [x for t in ids for x in rows_of[t]]
        req = Open(tenant, f"s{i}", ids, topk)
        t0 = time.perf_counter()
        entry, _ = await d.open(req)
        open_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        data = dumps(entry.session)
        encode_ms = (time.perf_counter() - t0) * 1e3
        d.release(entry)
        await d.flush()
        await other.store.set(entry.snapshot_key, data, 60)
        t0 = time.perf_counter()
        moved, source = await other.open(Open(tenant, f"s{i}", ids, []))
        restore_ms = (time.perf_counter() - t0) * 1e3
        assert source == "snapshot", source
        assert moved.session.history == entry.session.history
        other.release(moved)
        out.append(
            dict(
                tokens=len(ids),
                shared=len(entry.session.prefix) if entry.session.prefix is not None else 0,
                open_ms=open_ms,
                snapshot_kib=len(data) / 1024,
                encode_ms=encode_ms,
                restore_ms=restore_ms,
                memory_kib=entry.session.memory_estimate() / 1024,
                prefix_kib=d.prefixes.nbytes() / 1024,
            )
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", default=_DEFAULT_BFCL, help="tool sessions (JSONL or BFCL)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument(
        "--min-system-chars", type=int, default=12000, help="the first tenant with a system prompt this long"
    )
    ap.add_argument("--min-tokens", type=int, default=512, help="--shared-prefix-tokens when on")
    args = ap.parse_args()
    tok = tokenizer(args.model)
    prior = load_prior("default", DrafterConfig().topk)
    tenants = by_tenant(load(args.input))
    name, sessions = next(
        (n, ss) for n, ss in tenants.items() if len(ss) >= 2 and len(ss[0].system) >= args.min_system_chars
    )
    prompts = [messages_ids(tok, s.first_messages()) for s in sessions[: args.sessions]]
    runs = {"off": asyncio.run(measure(prompts, 0, prior)), "on": asyncio.run(measure(prompts, args.min_tokens, prior))}
    print(
        f"tenant {name}: {len(prompts)} sessions, first-turn prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens; medians over the later sessions (2 cores, shared machine: noisy)"
    )
    cols = ["shared", "open_ms", "snapshot_kib", "encode_ms", "restore_ms", "memory_kib", "prefix_kib"]
    head = ["shared prefixes", "tokens shared", "open ms", "snapshot KiB", "encode ms", "restore ms", "session KiB"]
    lines = ["| " + " | ".join(head + ["prefixes held KiB"]) + " |", "|" + "---|" * (len(head) + 1)]
    for run, rs in runs.items():
        later = rs[1:]
        cells = [run] + [f"{statistics.median(r[c] for r in later):.1f}" for c in cols[:-1]]
        cells.append(f"{rs[-1]['prefix_kib']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    first = runs["on"][0]
    print(
        f"first session (builds nothing shared yet): open {first['open_ms']:.1f} ms, "
        f"snapshot {first['snapshot_kib']:.0f} KiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
