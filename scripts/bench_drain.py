"""How long a verifier holding N streaming sessions takes to drain on SIGTERM, and where they go.

Starts Redis, a drafter, a gateway and two verifiers as processes (``racer serve``; the default
model unless ``--model``). Each repetition opens ``--sessions`` concurrent sessions on the first
verifier alone (the second is frozen with SIGSTOP: it answers no load report, so no session goes
there), waits until the first verifier's Stats shows every session streaming, wakes the second,
then sends the first SIGTERM and measures:

* drain: SIGTERM to its last stream ended (the verifier logs it: ``drained``, ``seconds``);
* exit: SIGTERM to the process's exit (the model thread stopped, the gRPC server closed).

Every turn must complete (the moved sessions continue on the second verifier). ``--scrape PATH``
writes the first verifier's /metrics while it holds the sessions: the recorded scrape that
``tests/deploy/test_autoscaling.py`` evaluates the recording rules on.

    PYTHONPATH=. python scripts/bench_drain.py [--sessions 8] [--repeat 3] [--model PATH] [--scrape PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from racer.client import Client  # noqa: E402
from racer.procs import RedisServer, Service, stop_all, wait_for  # noqa: E402


def drained_seconds(log: str) -> float | None:
    for line in reversed(log.splitlines()):
        if '"drained"' in line:
            return json.loads(line).get("seconds")
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256, help="per turn: long enough to be mid-turn at SIGTERM")
    ap.add_argument("--model", default="", help="a model directory (default: the bundled default model)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each verifier")
    ap.add_argument("--scrape", default="", help="write the loaded verifier's /metrics text here")
    args = ap.parse_args(argv)

    token = {"RACER_INTERNAL_TOKEN": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="racer-drain-"))
    redis = RedisServer(tmp / "redis").start()
    venv = {"RACER_THREADS": str(args.threads), "RACER_DRAIN_SECONDS": "60", **token}
    if args.model:
        venv["RACER_MODEL"] = args.model
    verifiers = [Service("verifier", dict(venv), tmp, f"verifier{i}") for i in range(2)]
    drafter = Service("drafter", {"RACER_SNAPSHOT_URL": redis.url, "RACER_PRIOR": "none", **token}, tmp, "drafter")
    gateway = Service(
        "gateway",
        {
            "RACER_MODEL": "none",
            "RACER_SESSION_URL": redis.url,
            "RACER_DRAFTERS": drafter.target,
            "RACER_VERIFIERS": ",".join(v.target for v in verifiers),
            "RACER_RECONNECT_SECONDS": "120",
            **token,
        },
        tmp,
    )
    rows = []
    try:
        first, second = verifiers
        for p in (drafter, gateway, second):
            p.start()
        for p in (drafter, gateway, second):
            p.wait_healthy(600)
        for rep in range(args.repeat):
            # The second verifier frozen: it answers no load report, so every new session goes to the first.
            second.signal(signal.SIGSTOP)
            first.start().wait_healthy(600)
            results: list[str] = []
            rng = random.Random(rep)

            def one(i: int) -> None:
                ids = [rng.randrange(10, 40000) for _ in range(64)]
                try:
                    with Client(gateway.target, timeout=600) as c:
                        got, _, _ = c.complete(ids, max_new_tokens=args.new_tokens, budget=8)
                    results.append("OK" if len(got) == args.new_tokens else f"{len(got)} tokens")
                except grpc.RpcError as e:
                    results.append(f"{e.code().name}: {e.details()}")

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.sessions)]
            for t in threads:
                t.start()
            wait_for(
                lambda: sum(s.streaming for s in first.sessions()) == args.sessions, 600, "every session streaming"
            )
            second.signal(signal.SIGCONT)
            if args.scrape and rep == 0:
                with urllib.request.urlopen(f"http://127.0.0.1:{first.metrics_port}/metrics", timeout=10) as r:
                    Path(args.scrape).write_bytes(r.read())
            streaming = sum(s.streaming for s in first.sessions())
            t0 = time.monotonic()
            first.signal(signal.SIGTERM)
            code = first.wait_exit(600)
            exit_s = time.monotonic() - t0
            for t in threads:
                t.join(900)
            ok = sum(r == "OK" for r in results)
            rows.append((streaming, drained_seconds(first.log_text()), exit_s, code, ok, len(results)))
            print(f"run {rep + 1}: {rows[-1]}", flush=True)
    finally:
        stop_all([*verifiers, drafter, gateway, redis])
    print("\n| run | sessions streaming at SIGTERM | drain (s) | SIGTERM to exit (s) | exit code | turns OK |")
    print("|---|---|---|---|---|---|")
    for i, (n, d, e, code, ok, total) in enumerate(rows, 1):
        print(f"| {i} | {n} | {d:.2f} | {e:.2f} | {code} | {ok}/{total} |")
    drains = [r[1] for r in rows if r[1] is not None]
    exits = [r[2] for r in rows]
    median_exit = statistics.median(exits)
    print(f"median drain {statistics.median(drains):.2f} s, max {max(drains):.2f} s; median exit {median_exit:.2f} s")


if __name__ == "__main__":
    main()
