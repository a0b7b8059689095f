"""``racer stack``: drafter, verifier and gateway as separate processes on localhost.

Starts them, waits for their health, streams one answer through the gateway, prints the stats
and stops them cleanly (SIGTERM, drain). ``--keep`` leaves the stack up for other clients until
Ctrl-C. With ``RACER_API_KEYS`` set the gateway authenticates its clients: the stack's own
requests carry the file's first key, and the line that says the stack is up tells how a client
authenticates.

The drafter and verifier accept only the gateway: the three share an internal token, random per
``racer`` process unless ``RACER_INTERNAL_TOKEN`` (or ``RACER_INTERNAL_TOKEN_FILE``) is set, so the
local demo does not hand every session to whoever can reach its ports.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

from common import settings
from common.settings import HEALTH_SERVICES, PORTS
from gateway.auth import load_api_keys

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
    """``racer serve SERVICE``; its stderr passes through ``_Output`` (``proc.output``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "racer.cli", "serve", service], env=env, start_new_session=True, stderr=subprocess.PIPE
    )
    proc.output = _Output(proc.stderr)
    return proc


class _Output:
    """A service's stderr, copied line by line to this process's stderr as it comes (its logs show
    as before), but for the line it ends with when it cannot start (``racer.exits.FATAL``): that one
    is held for ``failed``, which the stack reports as its own one line. The last lines are kept."""

    def __init__(self, stream, keep: int = 200):
        self.stream = stream
        self.held: list[str] = []  # start-up failure lines, not shown yet
        self.last: collections.deque[str] = collections.deque(maxlen=keep)
        self.thread = threading.Thread(target=self._copy, name="service-stderr", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        from .exits import FATAL

        # This thread never takes Ctrl-C or SIGTERM: ``run --keep`` waits for them in the main thread.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        for raw in iter(self.stream.readline, b""):
            line = raw.decode(errors="replace")
            self.last.append(line)
            if FATAL.match(line.strip()):
                self.held.append(line)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()
        self.stream.close()

    def failed(self, name: str, proc: subprocess.Popen):
        """``ServiceFailed`` for ``name``, which exited: the reason its output gave (read to its end)."""
        from .exits import ServiceFailed, reason

        self.thread.join(10)  # its last lines: the pipe ends once the process has exited
        self.held.clear()  # the exception reports them
        return ServiceFailed(name, reason("".join(self.last), proc.poll()))

    def flush(self) -> None:
        """Held lines nobody reported (a service that failed while another was awaited)."""
        for line in self.held:
            sys.stderr.write(line)
        self.held.clear()


def _ports(port_base: int, metrics_base: int) -> dict[str, tuple[int, int]]:
    """(gRPC port, metrics port) of each service of a local stack."""
    return {
        s: (port_base + i, metrics_base + i) if port_base else (PORTS[s][0], metrics_base + i)
        for i, s in enumerate(("gateway", "drafter", "verifier"))
    }


def target(service: str, port_base: int = 0) -> str:
    """Where ``running(port_base=...)`` serves ``service``."""
    return f"127.0.0.1:{_ports(port_base, 0)[service][0]}"


def client_key(environ: Mapping[str, str] | None = None) -> str | None:
    """What this process's own calls to a stack's gateway authenticate with: with ``RACER_API_KEYS``
    set, the first key of that file (None: keys are off). A file without keys refuses every call,
    so the stack refuses to start (``ValueError``)."""
    environ = os.environ if environ is None else environ
    path = environ.get("RACER_API_KEYS", "")
    if not path:
        return None
    keys = load_api_keys(path)
    if not keys:
        raise ValueError(f"RACER_API_KEYS={path}: the file holds no 'key tenant' line, so every call would be refused")
    return next(iter(keys))


def how_clients_authenticate(environ: Mapping[str, str] | None = None) -> str:
    """One line for the operator: how a client of the stack's gateway authenticates (no key printed)."""
    environ = os.environ if environ is None else environ
    path = environ.get("RACER_API_KEYS", "")
    if not path:
        return "clients need no key (RACER_API_KEYS unset: every call is tenant local)"
    tenant = load_api_keys(path)[client_key(environ)]
    return (
        f"clients send 'authorization: Bearer KEY' with a key of {path} (racer client --api-key KEY, or "
        f"RACER_API_KEY=KEY); this command's own requests use tenant {tenant}'s key"
    )


def _placed(split, envs) -> str:
    """Where ``common.cpus.placement`` put the services, in words."""
    from common import cpus

    everywhere, others = envs["verifier"]["RACER_CPUS"], envs["gateway"]["RACER_CPUS"]
    if envs["verifier"].get("RACER_ROUND_THREADS") == "0":
        return f"verifier on CPUs {everywhere}, the others on {others}"
    return (
        f"verifier rounds on CPUs {cpus.format_list(split[0])}, prefills and a lone stream's rounds on"
        f" {everywhere}, the others on {others}"
    )


def _environments(
    model: str,
    port_base: int,
    metrics_base: int,
    log_level: str,
    env: dict | None,
    dtype: str | None,
    http_port: int,
    ports_dir: str,
    any_ports: bool = False,
) -> tuple[dict[str, str], dict[str, tuple[int, int]], dict[str, dict[str, str]]]:
    """(the environment all three share, each service's ports, each service's environment).
    ``ports_dir``: each service writes where it listens to ``ports_dir/SERVICE.json`` once it does.
    ``any_ports``: every listener on a port the OS picks (the gateway's drafter and verifier are set
    once they listen: ``start_healthy``)."""
    base = dict(os.environ, RACER_MODEL=model, RACER_HOST="127.0.0.1", RACER_LOG_LEVEL=log_level, **(env or {}))
    if dtype:
        base["RACER_DTYPE"] = dtype
    if model != settings.default("verifier", "--model"):
        # The shipped prior is the default model's: another model's drafts would come from a foreign
        # vocabulary (ids past a smaller one are refused).
        base.setdefault("RACER_PRIOR", "none")
    if not base.get("RACER_INTERNAL_TOKEN") and not base.get("RACER_INTERNAL_TOKEN_FILE"):
        base["RACER_INTERNAL_TOKEN"] = _TOKEN
    ports = _ports(port_base, metrics_base)
    if any_ports:
        anywhere = dict(RACER_PORT="0", RACER_METRICS_PORT="-1")
        envs = {s: dict(base, **anywhere) for s in ports}
    else:
        envs = {s: dict(base, RACER_PORT=str(p), RACER_METRICS_PORT=str(m)) for s, (p, m) in ports.items()}
        envs["gateway"].update(
            RACER_DRAFTERS=f"127.0.0.1:{ports['drafter'][0]}", RACER_VERIFIERS=f"127.0.0.1:{ports['verifier'][0]}"
        )
    for service, e in envs.items():
        e["RACER_PORTS_FILE"] = os.path.join(ports_dir, f"{service}.json")
    if http_port:
        envs["gateway"]["RACER_HTTP_PORT"] = "-1" if any_ports else str(http_port)
    for service, e in envs.items():  # a malformed RACER_* variable stops the stack here, in one line
        settings.parse(service, environ=e)
    client_key(envs["gateway"])
    return base, ports, envs


def start_healthy(
    procs: dict[str, subprocess.Popen], envs: dict[str, dict[str, str]], targets: dict[str, str] | None = None
) -> dict[str, dict]:
    """Starts ``envs``' services in order, each group once the one before serves, and returns what
    each listens on ({"grpc": target, "metrics": port, "http": port}). The verifier measures its
    cost curve (the adaptive budget's input) at start-up: on a machine this small, the others'
    start-up would skew it, so they start once it is up. ``targets``: fixed gRPC targets; without
    them each service's ``RACER_PORTS_FILE`` says where it listens, and the gateway is given the
    drafter's and verifier's addresses from theirs.

    A service with a ``RACER_PORTS_FILE`` is asked for its health only once it has written the
    file, which it does once its own listeners are up: at a fixed target that another process
    serves (another stack's service, which answers SERVING), a service that could not bind exits
    without the file, and the stack stops with its reason instead of going on with the other's."""
    from common.health import wait_serving

    from .procs import wait_for

    def listening(s: str) -> dict:
        path = envs[s].get("RACER_PORTS_FILE")
        if path:
            wait_for(lambda: os.path.exists(path), 300, f"{s} listening", alive=lambda: procs[s].poll() is None)
            with open(path, encoding="utf-8") as f:
                where = json.load(f)
            if targets is None:
                return where
        metrics = int(envs[s]["RACER_METRICS_PORT"])
        return {"grpc": targets[s], "metrics": metrics, "http": int(envs[s].get("RACER_HTTP_PORT", 0))}

    def serving(s: str) -> dict:
        """What ``s`` listens on once it serves; ``ServiceFailed`` (one line: why) if it exits first."""
        from .exits import ServiceFailed

        try:
            where = listening(s)
            alive = procs[s].poll
            wait_serving(where["grpc"], HEALTH_SERVICES[s], timeout=300, alive=lambda: alive() is None, what=s)
            return where
        except (RuntimeError, TimeoutError) as e:
            output = getattr(procs[s], "output", None)
            if output is None:
                raise
            if procs[s].poll() is None:  # still running, not serving: a guard against a hang
                raise ServiceFailed(s, "still running, not serving (its log is above)", "did not serve in 300 s") from e
            raise output.failed(s, procs[s]) from None

    found: dict[str, dict] = {}
    groups = [("verifier",), ("drafter", "gateway")]
    if targets is None:  # the gateway is told where the drafter listens
        groups = [("verifier",), ("drafter",), ("gateway",)]
    for group in groups:
        for s in group:
            if s == "gateway" and targets is None:
                envs[s].update(RACER_DRAFTERS=found["drafter"]["grpc"], RACER_VERIFIERS=found["verifier"]["grpc"])
            procs[s] = _spawn(s, envs[s])
        for s in group:
            found[s] = serving(s)
    return found


def stop(procs) -> None:
    """SIGTERM to every process of ``procs`` (name, process) still running, then waits for each to
    drain; one still running after 30 s is killed."""
    for _, p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for name, p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            print(f"{name} did not stop in 30 s; killing it", file=sys.stderr)
            p.kill()
    for _, p in procs:
        output = getattr(p, "output", None)
        if output is not None:
            output.thread.join(10)  # the rest of its output, before this process goes on
            output.flush()


class Target(str):
    """A running stack's gateway target (``host:port``), with the ports it found: ``http_port`` (0:
    off) and ``metrics`` (each service's metrics port)."""

    http_port: int = 0
    metrics: dict[str, int] = {}


@contextlib.contextmanager
def running(
    model: str = settings.default("verifier", "--model"),
    port_base: int = 0,
    metrics_base: int = PORTS["gateway"][1],
    log_level: str = "WARNING",
    env: dict[str, str] | None = None,
    pin: bool = True,
    dtype: str | None = None,
    http_port: int = 0,
    any_ports: bool = False,
):
    """Starts the three services, waits for their health, yields the gateway target, stops them.

    ``http_port``: the gateway also serves the OpenAI-compatible HTTP API there (0: off).
    ``any_ports``: every listener on a port the OS picks (``port_base``, ``metrics_base`` and the
    value of ``http_port`` unused); the "stack up" line says which.

    ``pin`` (on two CPUs or more): the verifier's rounds run on CPUs of its own (the upper half),
    the drafter, the gateway and this thread (the client, and the threads it starts) on the others,
    as a deployment gives the verifier its own cores or GPU; a prefill, which they wait for, runs on
    every CPU (``common.cpus.placement``). Explicit ``RACER_CPUS`` in ``env``
    or the environment win.
    """
    from common import cpus
    from verifier.model import resolve_model_dir

    with contextlib.ExitStack() as cleanup:
        ports_dir = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="racer-stack-"))
        base, ports, envs = _environments(
            model, port_base, metrics_base, log_level, env, dtype, http_port, ports_dir, any_ports
        )
        resolve_model_dir(model)  # convert the default model once, before two services want it
        before = cpus.available()
        mine = _outer[0] if _outer else before  # a stack started inside another splits the same CPUs
        split = cpus.split_for_verifier(mine) if pin and "RACER_CPUS" not in base else None
        if split:
            for s in ("verifier", "drafter", "gateway"):
                envs[s].update(cpus.placement(split, s))
        procs: dict[str, subprocess.Popen] = {}
        _outer.append(mine)
        try:
            t0 = time.monotonic()
            fixed = None if any_ports else {s: f"127.0.0.1:{p}" for s, (p, _) in ports.items()}
            found = start_healthy(procs, envs, fixed)
            gateway = Target(found["gateway"]["grpc"])
            http = gateway.http_port = found["gateway"]["http"]
            gateway.metrics = {s: found[s]["metrics"] for s in ports}
            if split:  # the client side, off the verifier's CPUs (threads started from here on inherit it)
                cpus.confine(cpus.format_list(split[1]))
            print(
                f"stack up in {time.monotonic() - t0:.1f} s: gateway {gateway}"
                + (f", OpenAI API http://127.0.0.1:{http}/v1" if http else "")
                + ", metrics on "
                + ", ".join(f"{s} :{found[s]['metrics']}" for s in ports)
                + (f"; {_placed(split, envs)}" if split else "")
                + f"\n{how_clients_authenticate(envs['gateway'])}",
                file=sys.stderr,
            )
            yield gateway
        finally:
            _outer.pop()
            if split:
                cpus.confine(cpus.format_list(before))
            stop(procs.items())


def _has_template_file(path) -> bool:
    """Whether a model directory's tokenizer files name a chat template (read without loading it)."""
    from pathlib import Path

    path = Path(path)
    if (path / "chat_template.jinja").exists() or (path / "chat_template.json").exists():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def text_prompt(model: str, prompt: str, chat_template: str = "") -> list[int] | None:
    """The prompt's token ids as plain text (a completion, no system prompt) when ``model`` has no
    chat template and none was given (``chat_template``: the operator's file), so the gateway would
    refuse it as chat; None: the prompt goes as a chat message. The tokenizer is loaded only when the
    model directory names no template."""
    from verifier.model import resolve_model_dir

    if chat_template:
        return None
    path = resolve_model_dir(model)
    if _has_template_file(path):
        return None
    from transformers import AutoTokenizer

    from common.text import has_chat_template, text_ids

    tokenizer = AutoTokenizer.from_pretrained(path)
    if has_chat_template(tokenizer):
        return None
    return text_ids(tokenizer, prompt)


def _answer(gateway: str, args) -> int:
    """Streams the answer to ``args.prompt`` through the stack; 1 (with the status) when the call fails.
    A model without a chat template continues the prompt as text."""
    import grpc

    from .client import Client, format_stats

    prompt, system = args.prompt, args.system
    ids = text_prompt(args.model, prompt, args.chat_template)
    if ids is not None:
        print(
            f"racer: {args.model} has no chat template, so the prompt is continued as text "
            "(--chat-template FILE gives it one)",
            file=sys.stderr,
        )
        prompt, system = ids, ""
    with Client(gateway, api_key=client_key()) as c:
        last = None
        try:
            for r in c.generate(
                prompt, max_new_tokens=args.max_new_tokens, mode=args.mode, budget=args.budget, system=system
            ):
                sys.stdout.write(r.text)
                sys.stdout.flush()
                last = r
        except grpc.RpcError as e:
            print(f"racer: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
        print(format_stats(last), file=sys.stderr)
    return 0


def run(args) -> int:
    with running(
        args.model,
        args.port_base,
        args.metrics_base,
        args.log_level,
        pin=args.pin,
        dtype=args.dtype,
        http_port=args.http_port,
        any_ports=args.any_ports,
        env={"RACER_CHAT_TEMPLATE": args.chat_template} if args.chat_template else None,
    ) as gateway:
        if args.prompt and _answer(gateway, args):
            return 1
        if args.keep:
            print("stack running; Ctrl-C stops it", file=sys.stderr)
            # Blocked first: an unblocked SIGTERM would kill this process before sigwait sees it,
            # leaving the three services running without their parent.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0
