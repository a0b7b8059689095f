"""Local processes of the services (``racer serve KIND``) and of ``redis-server``, on addresses no
other program can take between a choice and a bind.

A port picked free and handed to a process later is a race: something else may bind it in
between. So nothing here picks a port:

* a drafter or verifier listens on a Unix domain socket in a private directory (``--host
  unix:PATH``): the path is known before the process starts, so a gateway can be given it, and a
  restart listens on the same path again;
* a gateway's gRPC port, every metrics port and the HTTP port are bound to port 0 by the process
  itself, which writes the ports it got to its ``--ports-file``; they are read back from there after
  each start (a restart may get other ports);
* ``redis-server`` listens on a Unix socket only (``--port 0``), so a restart from its
  append-only file is reached at the same URL.

``racer stack``, the soak, the benchmarks that run real processes and the tests all start
services through these classes.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common.health import wait_serving
from common.settings import HEALTH_SERVICES

_SOCKETS: list[str] = []  # the private directory of this process's sockets, made on first use


def socket_dir() -> Path:
    """A short private directory for Unix sockets (a socket's path must fit in 107 bytes), removed
    when this process exits."""
    if not _SOCKETS:
        path = tempfile.mkdtemp(prefix="racer-")
        _SOCKETS.append(path)
        atexit.register(shutil.rmtree, path, True)
    return Path(_SOCKETS[0])


def wait_for(cond, timeout: float, what, every: float = 0.05, alive=None) -> float:
    """Polls ``cond`` until it is true; the seconds that took. ``RuntimeError`` as soon as ``alive()``
    is false; ``TimeoutError`` naming ``what`` (or what it returns, if callable) past ``timeout``
    (a guard against a hang, not a figure a test rests on)."""
    t0 = time.monotonic()
    while not cond():
        name = what() if callable(what) else what
        if alive is not None and not alive():
            raise RuntimeError(f"{name}: the process exited")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{name}: not reached in {timeout:.0f} s")
        time.sleep(every)
    return time.monotonic() - t0


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """A process's Prometheus samples: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def sample(samples: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


class Service:
    """One ``racer serve KIND`` process; ``env`` holds its RACER_* settings (the caller's own RACER_*
    variables are not passed on). Drafters and verifiers listen on a Unix socket (``unix=False``:
    a loopback port the process picks), gateways on a loopback port; metrics on a loopback port
    the process picks. ``start`` again after an exit restarts it with the same settings."""

    def __init__(
        self, kind: str, env: dict[str, str], log_dir: Path, name: str | None = None, unix: bool | None = None
    ):
        self.kind = kind
        self.name = name or kind
        self.log = Path(log_dir) / f"{self.name}.log"
        self.unix = kind != "gateway" if unix is None else unix
        tag = f"{self.name}-{os.getpid()}-{id(self):x}"
        self.socket = socket_dir() / f"{tag}.sock"
        self.ports_file = socket_dir() / f"{tag}.ports.json"
        base = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")}  # only the settings given here
        self.env = dict(
            base,
            RACER_HOST=f"unix:{self.socket}" if self.unix else "127.0.0.1",
            RACER_PORT="0",
            RACER_METRICS_PORT="-1",
            RACER_LOG_LEVEL="INFO",
        )
        self.env.update(env)
        self.env["RACER_PORTS_FILE"] = str(self.ports_file)
        host = self.env["RACER_HOST"]  # ``env`` may name its own
        self.unix = host.startswith("unix:")
        if self.unix:
            self.socket = Path(host[len("unix:") :])
        self.proc: subprocess.Popen | None = None
        self._ports: dict | None = None

    def start(self) -> "Service":
        self.ports_file.unlink(missing_ok=True)
        self._ports = None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "racer.cli", "serve", self.kind],
                env=self.env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        return self

    def ports(self, timeout: float = 300.0) -> dict:
        """What the running process listens on, from its ports file (waits until it serves)."""
        if self._ports is None:
            try:
                wait_for(self.ports_file.exists, timeout, f"{self.name} listening", alive=self.alive)
            except (RuntimeError, TimeoutError) as e:
                raise type(e)(f"{e}:\n{self.log_text()[-3000:]}") from None
            self._ports = json.loads(self.ports_file.read_text())
        return self._ports

    @property
    def target(self) -> str:
        """Where clients dial its gRPC server (known before it starts for a Unix socket)."""
        return f"unix:{self.socket}" if self.unix else self.ports()["grpc"]

    @property
    def metrics_port(self) -> int:
        return self.ports()["metrics"]

    @property
    def http_port(self) -> int:
        return self.ports()["http"]

    def wait_healthy(self, timeout: float = 300.0) -> "Service":
        """Waits until it serves (its health service says SERVING). ``timeout`` guards against a
        hang only: a verifier's start-up tunes its kernels, minutes on a loaded small machine."""
        try:
            self.ports(timeout)
            wait_serving(self.target, HEALTH_SERVICES[self.kind], timeout, alive=self.alive, what=self.name)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}:\n{self.log_text()[-3000:]}") from None
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def terminate(self, timeout: float = 30.0) -> None:
        """SIGTERM (it drains), then waits; killed if still running after ``timeout``."""
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stopped(self) -> bool:
        """Whether the process is stopped by a signal (SIGSTOP): state T in /proc (Linux)."""
        with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def scrape(self) -> dict[tuple[str, tuple], float]:
        return scrape(self.metrics_port)

    def metric(self, name: str, **labels) -> float:
        """The sum of the process's samples of ``name`` with ``labels`` (0 when absent)."""
        return sample(self.scrape(), name, **labels)

    def sessions(self):
        """Stats of a drafter or verifier: the sessions it holds (asked with its internal token)."""
        import grpc

        from common import identity
        from common.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

        token = self.env.get("RACER_INTERNAL_TOKEN", "")
        meta = identity.metadata((token,)) if token else ()
        with grpc.insecure_channel(self.target) as ch:
            if self.kind == "drafter":
                stub = drafter_pb2_grpc.DrafterStub(ch)
                stats = stub.Stats(drafter_pb2.DrafterStatsRequest(), timeout=5, metadata=meta)
            else:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                stats = stub.Stats(verifier_pb2.VerifierStatsRequest(), timeout=5, metadata=meta)
        return list(stats.sessions)


def stop_all(procs) -> None:
    """Every process of ``procs`` (services and Redis servers) continued if frozen and stopped."""
    for p in procs:
        if p.alive():
            p.proc.send_signal(signal.SIGCONT)
        if isinstance(p, RedisServer):
            p.stop()
        else:
            p.kill()


class RedisServer:
    """``redis-server`` on a Unix socket of its own, no TCP port. ``appendonly``: an append-only file
    in ``workdir`` written at every command, so a stop and a start keep the data (as deployed);
    ``password``: ``requirepass`` as deployed (``url`` carries it)."""

    def __init__(self, workdir: Path, password: str = "", appendonly: bool = True):
        self.exe = shutil.which("redis-server")
        if not self.exe:
            raise RuntimeError("no redis-server on PATH; run scripts/setup.sh")
        self.password = password
        self.appendonly = appendonly
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = socket_dir() / f"redis-{os.getpid()}-{id(self):x}.sock"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.socket}?db=0"

    def start(self, timeout: float = 60.0) -> "RedisServer":
        import redis

        persist = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                "0",
                "--unixsocket",
                str(self.socket),
                "--unixsocketperm",
                "700",
                "--dir",
                str(self.dir),
                "--save",
                "",
                *persist,
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        r = self.client()

        def answers() -> bool:
            try:
                return bool(r.ping())
            except (redis.exceptions.BusyLoadingError, redis.ConnectionError):
                return False

        wait_for(answers, timeout, "redis-server answering PING", alive=self.alive)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def client(self):
        import redis

        return redis.Redis(unix_socket_path=str(self.socket), password=self.password or None)

    def raw_connection(self, timeout: float = 10.0) -> socket.socket:
        """A plain socket to the server: what any client that reaches it can send."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(str(self.socket))
        return s
