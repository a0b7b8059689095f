"""A drained session's hand-over and a joining verifier's warm-up against cold prefills (a script that
prints a table).

    python -m racer.bench.prefix_handover [--dtype float32,auto] [--prompt-tokens 3000] [--reps 2]

Three verifier processes per dtype (``racer serve verifier``, one thread each, started one after the
other so the later ones read the first's kernel plan: equal fingerprints), A, B and C; C starts
after the sessions below exist on A (it joins). Per repetition (a tenant of its own), called as a
gateway calls them:

* hand-over: a session's first turn on A (its prompt: BFCL tool documentation of about
  ``--prompt-tokens`` tokens and a question, in the model's chat template; ``--turn-tokens`` greedy
  tokens out), then its next turn opened on B naming A and the session (a drained session moving:
  ``PrefixSource.session_id``), against the same history opened on B by a tenant nothing is cached
  for (the re-prefill a move costs without a hand-over);
* warm-up: once the sessions exist, C is started and asked to warm from A (``Verifier.Warm``, what a
  gateway does when it first sees a verifier); then a new session of each tenant on C (the same
  tool documentation, another question), against the same prompt of a tenant C holds nothing for.

The figure is the time from sending the open to its answer (the first token), at the client.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc

from ..procs import Service
from .harness import table
from .prefix import BFCL_MULTIPLE, tenant_prompts, tool_sets
from .prefix_fetch import METADATA, TOKEN, _stats


def _turn(target: str, tenant: str, sid: str, ids: list[int], n: int = 1, source=None) -> tuple[float, object, list]:
    """Opens ``sid`` with ``ids`` (naming ``source``: (address, blocks, session id)), then ``n - 1``
    one-token rounds; the session stays. (seconds to the first token, the open's answer, the tokens)."""
    q: queue.Queue = queue.Queue()
    op = vpb.VerifierOpen(session_id=sid, tenant=tenant, history=ids, reserve_tokens=n)
    if source is not None:
        op.prefix_source.CopyFrom(vpb.PrefixSource(address=source[0], blocks=source[1], session_id=source[2]))
    q.put(vpb.VerifyRequest(open=op))
    with grpc.insecure_channel(target) as ch:
        t0 = time.perf_counter()
        call = vgrpc.VerifierStub(ch).Session(iter(q.get, None), timeout=3600, metadata=METADATA)
        resp = next(call)
        seconds = time.perf_counter() - t0
        out = [resp.next_token]
        for _ in range(n - 1):
            q.put(vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[out[-1]], parents=[-1])))
            out.append(next(call).next_token)
        q.put(None)
        for _ in call:
            pass
    return seconds, resp, out


def _drop(target: str, tenant: str, sid: str) -> None:
    with grpc.insecure_channel(target) as ch:
        vgrpc.VerifierStub(ch).Drop(vpb.VerifierDropRequest(session_id=sid, tenant=tenant), metadata=METADATA)


def _warm(target: str, source: str) -> vpb.VerifierWarmResponse:
    with grpc.insecure_channel(target) as ch:
        req = vpb.VerifierWarmRequest(source=source)
        return vgrpc.VerifierStub(ch).Warm(req, timeout=3600, metadata=METADATA)


def run(dtype: str, model: str, sessions, block: int, turn_tokens: int, log_dir: Path) -> tuple[list, list]:
    env = {
        "RACER_MODEL": model,
        "RACER_DTYPE": dtype,
        "RACER_THREADS": "1",
        "RACER_MEASURE_COST": "0",
        "RACER_INTERNAL_TOKEN": TOKEN,
        "RACER_PREFIX_BLOCK_TOKENS": str(block),
        "RACER_PREFIX_FETCH": "always",
        "RACER_PREFIX_FETCH_SECONDS": "600",
        "RACER_PREFIX_WARM_SHARE": "0.5",
    }
    a, b, c = (Service("verifier", dict(env), log_dir, f"{dtype}-{n}") for n in "abc")
    started = [a, b]
    try:
        for v in (a, b):  # one after the other: the second reads the kernel plan the first measured
            v.start().wait_healthy(1800)
        served = _stats(a.target).setup.dtype
        for v in (a, b):  # first forwards pay for allocation: not measured
            _turn(v.target, "warm-up", "w", sessions[0][0][:200])
            _drop(v.target, "warm-up", "w")
        moved, nexts = [], []
        for i, (first, second, third) in enumerate(sessions):
            tenant = f"t{i}"
            _, _, out = _turn(a.target, tenant, "s", first, turn_tokens)  # the session's first turn, on A
            nxt = first + out + second
            handed, r, _ = _turn(b.target, tenant, "s", nxt, 1, (a.target, len(nxt) // block, "s"))
            cold, _, _ = _turn(b.target, f"u{i}", "s", nxt)
            _drop(b.target, f"u{i}", "s")
            moved.append((served, len(nxt), r.fetched_tokens, cold, handed))
            nexts.append(third)  # a new session of the tenant: the same tool docs, another question
        started.append(c)
        c.start().wait_healthy(1800)  # joins
        _turn(c.target, "warm-up", "w", sessions[0][0][:200])
        _drop(c.target, "warm-up", "w")
        t0 = time.perf_counter()
        w = _warm(c.target, a.target)
        warm_s = time.perf_counter() - t0
        print(f"{dtype}: C warmed {w.blocks} blocks ({w.bytes / 1e6:.0f} MB) in {warm_s:.2f} s {w.refused}")
        joined = []
        for i, ids in enumerate(nexts):
            hit, r, _ = _turn(c.target, f"t{i}", "w", ids)
            cold, _, _ = _turn(c.target, f"v{i}", "w", ids)
            joined.append((served, len(ids), r.prefix_tokens, r.fetched_tokens, cold, hit))
        return moved, joined
    finally:
        for v in started:
            v.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m racer.bench.prefix_handover", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32,auto", help="comma-separated: each runs its own verifiers")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--turn-tokens", type=int, default=32, help="greedy tokens of the session's first turn")
    p.add_argument("--reps", type=int, default=2, help="tenants, each a session moved and a session on C")
    p.add_argument("--block", type=int, default=64, help="prefix block tokens")
    p.add_argument("--data", default=str(BFCL_MULTIPLE))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from verifier.model import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    sets = tool_sets(Path(args.data))
    prompts = [s for _, s in tenant_prompts(tok, sets, args.reps, args.prompt_tokens, 3)]
    # per tenant: its first prompt; the next turn's input (the second prompt past the docs it shares
    # with the first: a user message); and the third prompt, for its new session on C
    sessions = []
    for first, second, third in prompts:
        shared = next((i for i, (x, y) in enumerate(zip(first, second)) if x != y), min(len(first), len(second)))
        sessions.append((first, second[shared:], third))
    moved, joined = [], []
    with tempfile.TemporaryDirectory(prefix="racer-bench-handover-") as tmp:
        for dtype in args.dtype.split(","):
            m, j = run(dtype, args.model, sessions, args.block, args.turn_tokens, Path(tmp))
            moved, joined = moved + m, joined + j
    head = ("dtype", "history", "handed over", "re-prefill (s)", "hand-over (s)", "ratio")
    rows = ((d, str(n), str(f), f"{c:.2f}", f"{h:.2f}", f"{h / c:.3f}") for d, n, f, c, h in moved)
    print(table(head, rows))
    head = ("dtype", "prompt", "copied", "fetched at open", "cold (s)", "warm (s)", "ratio")
    rows = ((d, str(n), str(pt), str(f), f"{c:.2f}", f"{h:.2f}", f"{h / c:.3f}") for d, n, pt, f, c, h in joined)
    print(table(head, rows))
    for d in dict.fromkeys(r[0] for r in moved):
        hand = statistics.median(r[4] / r[3] for r in moved if r[0] == d)
        warm = statistics.median(r[5] / r[4] for r in joined if r[0] == d)
        print(f"{d}: first token, hand-over / re-prefill median {hand:.3f}x; warm / cold on a joined one {warm:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
