"""Services as real processes (``racer serve ...``) and a real ``redis-server`` that tests can kill,
freeze, stop and restart on the same ports."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from common.health import wait_serving
from common.settings import HEALTH_SERVICES
from common.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from .stack import BACKEND_METADATA, INTERNAL_TOKEN
from .stack import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
_TAKEN: set[int] = set()


def free_port() -> int:
    """A free port this test process has not handed out before (the OS may offer one twice)."""
    while True:
        port = _free_port()
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port


class Proc:
    """One ``racer serve KIND`` process; ``env`` holds its RACER_* settings. Restarts keep the ports."""

    def __init__(self, kind: str, env: dict[str, str], log_dir: Path, name: str | None = None):
        self.kind = kind
        self.name = name or kind
        self.port = free_port()
        self.metrics_port = free_port()
        self.log = log_dir / f"{self.name}.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")}  # only the settings given here
        self.env = dict(
            base,
            OMP_NUM_THREADS="1",
            RACER_HOST="127.0.0.1",
            RACER_PORT=str(self.port),
            RACER_METRICS_PORT=str(self.metrics_port),
            RACER_LOG_LEVEL="INFO",
            RACER_INTERNAL_TOKEN=INTERNAL_TOKEN,  # the gateway sends it, drafters and verifiers require it
        )
        self.env.update(env)
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Proc":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "racer.cli", "serve", self.kind],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        return self

    def wait_healthy(self, timeout: float = 60.0) -> "Proc":
        try:
            wait_serving(self.target, HEALTH_SERVICES[self.kind], timeout, alive=self.alive, what=self.name)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}:\n{self.log_text()[-3000:]}") from None
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
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

    def metric(self, name: str, **labels) -> float:
        """A sample from the process's Prometheus endpoint (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def sessions(self):
        """Stats of a drafter or verifier: the sessions it holds."""
        with grpc.insecure_channel(self.target) as ch:
            if self.kind == "drafter":
                return list(
                    drafter_pb2_grpc.DrafterStub(ch)
                    .Stats(drafter_pb2.DrafterStatsRequest(), timeout=5, metadata=BACKEND_METADATA)
                    .sessions
                )
            return list(
                verifier_pb2_grpc.VerifierStub(ch)
                .Stats(verifier_pb2.VerifierStatsRequest(), timeout=5, metadata=BACKEND_METADATA)
                .sessions
            )


def verifier_procs(n: int, model_dir: Path, log_dir: Path, env: dict[str, str]) -> list[Proc]:
    """``n`` verifier processes (not started) of the model saved in ``model_dir``: one thread each, the
    hand-written Llama forward, ``env`` added."""
    backend = {"RACER_MODEL": str(model_dir), "RACER_THREADS": "1", "RACER_BACKEND": "llama"}
    return [Proc("verifier", dict(env, **backend), log_dir, f"verifier{i}") for i in range(n)]


def drafter_procs(n: int, snapshot_url: str, log_dir: Path, env: dict[str, str]) -> list[Proc]:
    """``n`` drafter processes (not started) snapshotting to ``snapshot_url``, with no prior, ``env`` added."""
    store = {"RACER_SNAPSHOT_URL": snapshot_url, "RACER_PRIOR": "none"}
    return [Proc("drafter", dict(env, **store), log_dir, f"drafter{i}") for i in range(n)]


class RedisProc:
    """redis-server with an append-only file, so a stop and restart keeps the data (as deployed);
    with ``password``, ``requirepass`` as deployed (``url`` carries it)."""

    def __init__(self, workdir: Path, password: str = ""):
        self.password = password
        self.exe = shutil.which("redis-server")
        if not self.exe:
            raise RuntimeError("no redis-server on PATH; run scripts/setup.sh")
        self.port = free_port()
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProc":
        import redis

        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        r = self.client()
        for _ in range(200):
            try:
                r.ping()
                return self
            except redis.exceptions.BusyLoadingError:
                time.sleep(0.05)
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)

    def client(self):
        import redis

        return redis.Redis(port=self.port, password=self.password or None)


def reap(procs) -> None:
    for p in procs:
        try:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
        if isinstance(p, RedisProc):
            p.stop()
        else:
            p.kill()
