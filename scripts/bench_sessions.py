"""Sessions per verifier: time per output token and saturation against concurrent sessions.

Starts Redis, one verifier (the default model unless ``--model``), one drafter and one gateway as
processes (``racer serve``), then for each count in ``--sessions`` runs ``racer load``'s driver
(that many concurrent sessions x ``--turns`` turns of ``--max-new-tokens`` tokens) while it samples
the verifier's ``racer_verifier_saturation`` every 0.25 s. Prints one row per count, then the
capacity at ``--target-tpot-ms`` (the most sessions whose p50 time per output token meets it) and
where the autoscalers settle: they want ceil(sum of saturation / 0.8) verifiers, i.e. as many as
keep each verifier's saturation at 0.8, so S sessions need ceil(S / sessions at saturation 0.8).

    PYTHONPATH=. python scripts/bench_sessions.py [--sessions 1,2,4,8,12] [--threads 2] [--target-tpot-ms 100]

On a GPU run the same with ``--model`` and a CUDA verifier (RACER_DEVICE=cuda in the environment
is passed on): the table's shape is the same, its numbers are the GPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import statistics
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from racer.bench.loadgen import run_load  # noqa: E402
from racer.procs import RedisServer, Service, stop_all  # noqa: E402


def saturation(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "racer_verifier_saturation":
                return s.value
    return 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,2,4,8,12")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=0, help="draft budget (0: adaptive)")
    ap.add_argument("--model", default="", help="a model directory (default: the bundled default model)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the verifier")
    ap.add_argument("--target-tpot-ms", type=float, default=100.0)
    ap.add_argument("--load", type=int, default=64, help="concurrent sessions to size the replicas for")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.sessions.split(",")]

    token = {"RACER_INTERNAL_TOKEN": secrets.token_urlsafe(32)}
    tmp = Path(tempfile.mkdtemp(prefix="racer-sessions-"))
    redis = RedisServer(tmp / "redis").start()
    model = {"RACER_MODEL": args.model} if args.model else {}
    device = {"RACER_DEVICE": os.environ["RACER_DEVICE"]} if "RACER_DEVICE" in os.environ else {}
    verifier = Service(
        "verifier",
        dict(model, **device, **token, RACER_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads)),
        tmp,
    )
    drafter = Service("drafter", {"RACER_SNAPSHOT_URL": redis.url, "RACER_PRIOR": "none", **token}, tmp)
    gateway = Service(
        "gateway",
        dict(
            model,
            RACER_SESSION_URL=redis.url,
            RACER_DRAFTERS=drafter.target,
            RACER_VERIFIERS=verifier.target,
            RACER_MAX_SESSIONS_PER_TENANT="0",
            **token,
        ),
        tmp,
    )
    rows = []
    try:
        for p in (verifier, drafter, gateway):
            p.start()
        for p in (verifier, drafter, gateway):
            p.wait_healthy(900)
        asyncio.run(run_load(gateway.target, 1, 1, 8, seed=99))  # warm-up: first forwards, first snapshot
        for n in counts:
            samples: list[float] = []
            done = threading.Event()

            def sample():
                while not done.wait(0.25):
                    samples.append(saturation(verifier.metrics_port))

            t = threading.Thread(target=sample, daemon=True)
            t.start()
            rep = asyncio.run(
                run_load(gateway.target, n, args.turns, args.max_new_tokens, seed=n, budget=args.budget, time_limit=600)
            )
            done.set()
            t.join()
            sat = statistics.median(samples) if samples else 0.0
            rows.append((n, rep, sat, max(samples, default=0.0)))
            print(f"{n} sessions: {rep.format().splitlines()[0]}; saturation median {sat:.2f}", flush=True)
    finally:
        stop_all([verifier, drafter, gateway, redis])

    print("\n| sessions | TPOT p50 / p99 (ms) | TTFT p50 / p99 (ms) | tok/s | saturation median / max | errors |")
    print("|---|---|---|---|---|---|")
    for n, rep, sat, top in rows:
        print(
            f"| {n} | {rep.itl_ms['p50']:.1f} / {rep.itl_ms['p99']:.1f} | {rep.ttft_ms['p50']:.0f} / "
            f"{rep.ttft_ms['p99']:.0f} | {rep.tokens_per_s:.1f} | {sat:.2f} / {top:.2f} | {sum(rep.errors.values())} |"
        )
    meets = [n for n, rep, _, _ in rows if rep.itl_ms["p50"] <= args.target_tpot_ms]
    at_target = max(meets) if meets else 0
    under = [n for n, _, sat, _ in rows if sat <= 0.8]
    at_sat = max(under) if under else 0
    print(f"\nsessions per verifier at p50 TPOT <= {args.target_tpot_ms:g} ms: {at_target}")
    print(f"sessions per verifier at saturation <= 0.8 (where the autoscalers settle): {at_sat}")
    for name, per in (("TPOT target", at_target), ("autoscaler", at_sat)):
        if per:
            print(f"{args.load} concurrent sessions -> {math.ceil(args.load / per)} verifiers ({name})")


if __name__ == "__main__":
    main()
