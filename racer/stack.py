"""``racer stack``: drafter, verifier and gateway as separate processes on localhost.

Starts them, waits for their health, streams one answer through the gateway, prints the stats
and stops them cleanly (SIGTERM, drain). ``--keep`` leaves the stack up for other clients until
Ctrl-C.

The drafter and verifier accept only the gateway: the three share an internal token, random per
``racer`` process unless ``RACER_INTERNAL_TOKEN`` (or ``RACER_INTERNAL_TOKEN_FILE``) is set, so the
local demo does not hand every session to whoever can reach its ports.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time

from common.settings import HEALTH_SERVICES, PORTS

_outer: list[list[int]] = []  # the CPUs of the running() calls this one is nested in
_TOKEN = secrets.token_urlsafe(32)  # the stacks' internal token when the environment names none


def internal_metadata() -> tuple[tuple[str, str], ...]:
    """What a call from this process to a stack's drafter or verifier carries (``bench-stack``
    reads the verifier's cost curve): the token ``running`` gives them."""
    from common.identity import load_tokens, metadata

    env = os.environ
    tokens = load_tokens(env.get("RACER_INTERNAL_TOKEN", ""), env.get("RACER_INTERNAL_TOKEN_FILE", ""))
    return metadata(tokens or (_TOKEN,))


def _spawn(service: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "racer.cli", "serve", service], env=env, start_new_session=True)


def _ports(port_base: int, metrics_base: int) -> dict[str, tuple[int, int]]:
    """(gRPC port, metrics port) of each service of a local stack."""
    return {
        s: (port_base + i, metrics_base + i) if port_base else (PORTS[s][0], metrics_base + i)
        for i, s in enumerate(("gateway", "drafter", "verifier"))
    }


def target(service: str, port_base: int = 0) -> str:
    """Where ``running(port_base=...)`` serves ``service``."""
    return f"127.0.0.1:{_ports(port_base, 0)[service][0]}"


@contextlib.contextmanager
def running(
    model: str = "default",
    port_base: int = 0,
    metrics_base: int = 9100,
    log_level: str = "WARNING",
    env: dict[str, str] | None = None,
    pin: bool = True,
    dtype: str | None = None,
    http_port: int = 0,
):
    """Starts the three services, waits for their health, yields the gateway target, stops them.

    ``http_port``: the gateway also serves the OpenAI-compatible HTTP API there (0: off).

    ``pin`` (on two CPUs or more): the verifier runs on CPUs of its own (the upper half), the
    drafter, the gateway and this thread (the client, and the threads it starts) on the others,
    as a deployment gives the verifier its own cores or GPU. Explicit ``RACER_CPUS`` in ``env``
    or the environment win.
    """
    from common import cpus
    from common.health import wait_serving
    from verifier.model import resolve_model_dir

    resolve_model_dir(model)  # convert the default model once, before two services want it
    base = dict(os.environ, RACER_MODEL=model, RACER_HOST="127.0.0.1", RACER_LOG_LEVEL=log_level, **(env or {}))
    if dtype:
        base["RACER_DTYPE"] = dtype
    if not base.get("RACER_INTERNAL_TOKEN") and not base.get("RACER_INTERNAL_TOKEN_FILE"):
        base["RACER_INTERNAL_TOKEN"] = _TOKEN
    ports = _ports(port_base, metrics_base)
    envs = {s: dict(base, RACER_PORT=str(p), RACER_METRICS_PORT=str(m)) for s, (p, m) in ports.items()}
    envs["gateway"].update(
        RACER_DRAFTERS=f"127.0.0.1:{ports['drafter'][0]}", RACER_VERIFIERS=f"127.0.0.1:{ports['verifier'][0]}"
    )
    if http_port:
        envs["gateway"]["RACER_HTTP_PORT"] = str(http_port)
    before = cpus.available()
    mine = _outer[0] if _outer else before  # a stack started inside another splits the same CPUs
    split = cpus.split_for_verifier(mine) if pin and "RACER_CPUS" not in base else None
    if split:
        for s, group in (("verifier", split[0]), ("drafter", split[1]), ("gateway", split[1])):
            envs[s]["RACER_CPUS"] = cpus.format_list(group)
    procs: dict[str, subprocess.Popen] = {}
    _outer.append(mine)
    try:
        t0 = time.monotonic()
        # The verifier measures its cost curve (the adaptive budget's input) at start-up: on a
        # machine this small, the others' start-up would skew it, so they start once it is up.
        for group in (("verifier",), ("drafter", "gateway")):
            for s in group:
                procs[s] = _spawn(s, envs[s])
            for s in group:
                wait_serving(
                    f"127.0.0.1:{ports[s][0]}",
                    HEALTH_SERVICES[s],
                    timeout=300,
                    alive=lambda p=procs[s]: p.poll() is None,
                    what=s,
                )
        gateway = f"127.0.0.1:{ports['gateway'][0]}"
        if split:  # the client side, off the verifier's CPUs (threads started from here on inherit it)
            cpus.confine(cpus.format_list(split[1]))
        print(
            f"stack up in {time.monotonic() - t0:.1f} s: gateway {gateway}"
            + (f", OpenAI API http://127.0.0.1:{http_port}/v1" if http_port else "")
            + ", metrics on "
            + ", ".join(f"{s} :{m}" for s, (_, m) in ports.items())
            + (
                f"; verifier on CPUs {envs['verifier']['RACER_CPUS']}, the others on {envs['gateway']['RACER_CPUS']}"
                if split
                else ""
            ),
            file=sys.stderr,
        )
        yield gateway
    finally:
        _outer.pop()
        if split:
            cpus.confine(cpus.format_list(before))
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for s, p in procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"{s} did not stop in 30 s; killing it", file=sys.stderr)
                p.kill()


def run(args) -> int:
    from .client import Client, format_stats

    with running(
        args.model,
        args.port_base,
        args.metrics_base,
        args.log_level,
        pin=args.pin,
        dtype=getattr(args, "dtype", None),
        http_port=getattr(args, "http_port", 0),
    ) as gateway:
        if args.prompt:
            with Client(gateway) as c:
                last = None
                for r in c.generate(
                    args.prompt,
                    max_new_tokens=args.max_new_tokens,
                    mode=args.mode,
                    budget=args.budget,
                    system=args.system,
                ):
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
                    last = r
                sys.stdout.write("\n")
                print(format_stats(last), file=sys.stderr)
        if args.keep:
            print("stack running; Ctrl-C stops it", file=sys.stderr)
            # Blocked first: an unblocked SIGTERM would kill this process before sigwait sees it,
            # leaving the three services running without their parent.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0
