"""Services as real processes (``racer serve ...``) and a real ``redis-server`` that tests can kill,
freeze, stop and restart on the same ports."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import grpc
from prometheus_client.parser import text_string_to_metric_families

from common.errors import DRAINING
from common.health import wait_serving
from common.settings import HEALTH_SERVICES
from common.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from .stack import BACKEND_METADATA, INTERNAL_TOKEN, wait_until
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
        request = drafter_pb2.DrafterStatsRequest() if self.kind == "drafter" else verifier_pb2.VerifierStatsRequest()
        with grpc.insecure_channel(self.target) as ch:
            return list(self._stub(ch).Stats(request, timeout=5, metadata=BACKEND_METADATA).sessions)

    def refuses_as_draining(self) -> bool:
        """Whether the drafter or verifier refuses a ``Session`` message as draining (its SIGTERM drain
        has begun). The probe is one empty message, which a backend that is not draining refuses as
        INVALID_ARGUMENT: it opens no session and changes nothing."""
        empty = drafter_pb2.DraftRequest() if self.kind == "drafter" else verifier_pb2.VerifyRequest()
        with grpc.insecure_channel(self.target) as ch:
            try:
                list(self._stub(ch).Session(iter([empty]), timeout=5, metadata=BACKEND_METADATA))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    return False
                if e.code() == grpc.StatusCode.UNAVAILABLE and (e.details() or "").startswith(DRAINING):
                    return True
                raise
        raise AssertionError(f"{self.name} answered an empty Session message")

    def _stub(self, channel: grpc.Channel):
        if self.kind == "drafter":
            return drafter_pb2_grpc.DrafterStub(channel)
        return verifier_pb2_grpc.VerifierStub(channel)


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


@contextlib.contextmanager
def frozen(procs: list[Proc]) -> Iterator[None]:
    """Inside, every process of ``procs`` is stopped (SIGSTOP, seen in /proc), so its peers' calls to
    it wait; after, they all continue (SIGCONT). Keep it short: a peer's keepalive drops a silent
    process after ``RACER_KEEPALIVE_SECONDS`` twice over, and a gateway's streams to it fail over
    after ``RACER_BACKEND_TIMEOUT``."""
    try:
        for p in procs:
            p.signal(signal.SIGSTOP)
        wait_until(lambda: all(p.stopped() for p in procs), what="the processes stopped")
        yield
    finally:
        for p in procs:
            p.signal(signal.SIGCONT)


class TurnSpan(NamedTuple):
    """A running turn, in its session's tokens: it began when the session held ``base`` (its history
    and the turn's input) and ends when the session holds ``end`` (``base`` + max_new_tokens)."""

    base: int
    end: int


def drain_mid_turn(
    victims: list[Proc], held: list[Proc], turns: Callable[[], dict[str, TurnSpan]], budget: int, timeout: float
) -> Proc:
    """SIGTERMs one of ``victims`` (drafters, or verifiers) while a turn streams through it with
    rounds still to come, and returns it once its drain has begun: that turn's next message to it is
    then refused as draining, and the session moves (``racer_sessions_moved_total{reason="drain"}``).

    Picking a victim that shows a stream and then signalling it is a race: the turn may end in
    between, and the drain has nothing to move. So ``held`` (the live backends of the other kind,
    which every round also needs) are frozen from before the victim is chosen until it is seen
    draining. Until they continue, a turn sends the victim at most one more message, the one its
    gateway may already be able to send (a verifier's answer on its way lets it send a drafter one
    more step; a drafter's tree, a verifier one more tree). The victim's Stats show how far the turn
    got with it (a drafter holds the turn's prompt and every emitted token but the last; a verifier's
    cache at least that), and a round emits at most ``budget`` tokens: a turn with more than two
    rounds' tokens still to come has a message left for the victim once ``held`` continue. By then
    the victim refuses every message: it is seen refusing one as draining (``refuses_as_draining``),
    so nothing rests on how soon its event loop runs the SIGTERM drain, and from then on each
    message of each stream is refused as it arrives (``common/session_stream.py``).

    ``turns()``: the running turns by session id, each listed once its first chunk arrived (its
    streams are open; a backend holds one stream per session, so an earlier turn's is closed). It
    is read before the Stats: a stream they show for a listed session is that turn's, or a later
    turn's, which holds at least ``end - 1`` tokens and is not chosen."""
    deadline = time.monotonic() + timeout
    while True:
        what = f"a turn with rounds to come on one of {[p.name for p in victims]}"
        wait_until(lambda: _mid_turn(victims, turns, budget), max(0.0, deadline - time.monotonic()), what)
        with frozen(held):
            victim = _mid_turn(victims, turns, budget)
            if victim is not None:
                victim.signal(signal.SIGTERM)
                wait_until(victim.refuses_as_draining, what=f"{victim.name} draining")
                return victim


def _mid_turn(victims: list[Proc], turns: Callable[[], dict[str, TurnSpan]], budget: int) -> Proc | None:
    """The first of ``victims`` that a running turn streams through with more than two rounds of at
    most ``budget`` tokens still to emit: of the turn, the backend holds ``tokens - base`` tokens,
    so at most ``tokens - base + 1`` went out (the last emitted one is fed with the next round)."""
    spans = turns()
    for p in victims:
        if not p.alive():
            continue
        for s in p.sessions():
            span = spans.get(s.session_id)
            tokens = s.tokens if p.kind == "drafter" else s.cache_tokens
            if s.streaming and span is not None and span.base <= tokens and span.end - tokens - 1 > 2 * budget:
                return p
    return None
