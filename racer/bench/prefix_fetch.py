"""Prefix blocks fetched from another verifier against a cold prefill (a script that prints a table).

    python -m racer.bench.prefix_fetch [--dtype float32,auto] [--prompt-tokens 3000] [--reps 2]

Two verifier processes (``racer serve verifier``, one thread each, started one after the other so
the second reads the first's kernel plan: equal fingerprints). A tenant's prompt is BFCL tool
documentation of about ``--prompt-tokens`` tokens plus a user question, in the model's chat
template. Per repetition (a tenant of its own): its prompt opened on verifier 0 (cold: it prefills
all, and caches the blocks), then on verifier 1 naming verifier 0 as the blocks' holder (fetched:
the blocks move, the rest is prefilled), then on verifier 0 again (a local hit, for reference).
The figure is the time from sending the open to its answer (the first token), at the client.
Verifier 1 runs ``--prefix-fetch always`` so the transfer is measured whatever the rule would say;
the rule's own estimates are printed beside it.
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

from common import identity
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc

from ..procs import Service
from .harness import table
from .prefix import BFCL_MULTIPLE, tenant_prompts, tool_sets

TOKEN = "bench-prefix-fetch-internal-token"
METADATA = identity.metadata((TOKEN,))


def _open(target: str, tenant: str, sid: str, ids: list[int], source=None) -> tuple[float, vpb.VerifyResponse]:
    q: queue.Queue = queue.Queue()
    op = vpb.VerifierOpen(session_id=sid, tenant=tenant, history=ids, reserve_tokens=1)
    if source is not None:
        op.prefix_source.CopyFrom(vpb.PrefixSource(address=source[0], blocks=source[1]))
    q.put(vpb.VerifyRequest(open=op))
    with grpc.insecure_channel(target) as ch:
        t0 = time.perf_counter()
        call = vgrpc.VerifierStub(ch).Session(iter(q.get, None), timeout=3600, metadata=METADATA)
        resp = next(call)
        seconds = time.perf_counter() - t0
        q.put(None)
        for _ in call:
            pass
        vgrpc.VerifierStub(ch).Drop(vpb.VerifierDropRequest(session_id=sid, tenant=tenant), metadata=METADATA)
    return seconds, resp


def _stats(target: str) -> vpb.VerifierStatsResponse:
    with grpc.insecure_channel(target) as ch:
        return vgrpc.VerifierStub(ch).Stats(vpb.VerifierStatsRequest(), timeout=60, metadata=METADATA)


def run(dtype: str, model: str, prompts, block: int, log_dir: Path) -> list[tuple]:
    env = {
        "RACER_MODEL": model,
        "RACER_DTYPE": dtype,
        "RACER_THREADS": "1",
        "RACER_MEASURE_COST": "0",
        "RACER_INTERNAL_TOKEN": TOKEN,
        "RACER_PREFIX_BLOCK_TOKENS": str(block),
        "RACER_PREFIX_FETCH": "always",
        "RACER_PREFIX_FETCH_SECONDS": "600",
    }
    vs = [Service("verifier", dict(env), log_dir, f"{dtype}-verifier{i}") for i in range(2)]
    try:
        for v in vs:  # one after the other: the second reads the kernel plan the first measured
            v.start().wait_healthy(1800)
        fps = [_stats(v.target).setup.prefix_fingerprint for v in vs]
        served = _stats(vs[0].target).setup.dtype
        print(f"{dtype}: serves {served}; fingerprints {'equal' if fps[0] == fps[1] else 'differ: ' + str(fps)}")
        for v in vs:  # first forwards pay for allocation: not measured
            _open(v.target, "warm-up", "w", prompts[0][:200])
        rows = []
        for i, ids in enumerate(prompts):
            tenant = f"t{i}"
            cold, _ = _open(vs[0].target, tenant, "a", ids)
            time.sleep(1.0)  # the prefix cache's copy of the blocks runs after the answer
            blocks = (len(ids) - 1) // block
            fetched, r = _open(vs[1].target, tenant, "b", ids, (vs[0].target, blocks))
            hit, h = _open(vs[0].target, tenant, "c", ids)
            m = vs[1].scrape()
            rate = m.get(("racer_verifier_prefix_fetch_bytes_per_second", ()), 0.0)
            per_token = m.get(("racer_verifier_prefill_seconds_per_token", ()), 0.0)
            rows.append((served, len(ids), r.fetched_tokens, cold, fetched, hit, rate, per_token))
        return rows
    finally:
        for v in vs:
            v.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m racer.bench.prefix_fetch", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32,auto", help="comma-separated: each runs its own two verifiers")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--reps", type=int, default=2, help="tenants, each a cold, a fetched and a local open")
    p.add_argument("--block", type=int, default=64, help="prefix block tokens")
    p.add_argument("--data", default=str(BFCL_MULTIPLE))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from verifier.model import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    sets = tool_sets(Path(args.data))
    prompts = [sessions[0] for _, sessions in tenant_prompts(tok, sets, args.reps, args.prompt_tokens, 1)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="racer-bench-fetch-") as tmp:
        for dtype in args.dtype.split(","):
            rows += run(dtype, args.model, prompts, args.block, Path(tmp))
    head = ("dtype", "prompt", "fetched", "cold (s)", "fetched (s)", "ratio", "local hit (s)", "MB/s", "ms/token")
    print(
        table(
            head,
            (
                (
                    d,
                    str(n),
                    str(f),
                    f"{c:.2f}",
                    f"{x:.2f}",
                    f"{x / c:.3f}",
                    f"{h:.2f}",
                    f"{r / 1e6:.0f}",
                    f"{t * 1e3:.2f}",
                )
                for d, n, f, c, x, h, r, t in rows
            ),
        )
    )
    for d in dict.fromkeys(r[0] for r in rows):
        ratios = [r[4] / r[3] for r in rows if r[0] == d]
        print(f"{d}: first token fetched / cold, median {statistics.median(ratios):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
