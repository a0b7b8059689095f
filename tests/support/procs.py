"""Services as real processes (``racer serve ...``) and a real ``redis-server`` that tests can kill,
freeze, stop and restart at the same addresses (racer/procs.py)."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import grpc

from common.errors import DRAINING
from common.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from racer.procs import RedisServer, Service

from .stack import BACKEND_METADATA, INTERNAL_TOKEN, wait_until

ROOT = Path(__file__).resolve().parents[2]


# What a test's verifier serves unless the test says otherwise: float32, whose reference is Hugging
# Face greedy decoding. Given to each process explicitly (``Service`` passes on none of the caller's
# RACER_* variables), never left to ``--dtype auto``, whose choice depends on the CPU.
DTYPE = "float32"


class Proc(Service):
    """One ``racer serve KIND`` process of the tests: the internal token the tests' gateways send,
    one OpenMP thread, INFO logs, a verifier's dtype ``DTYPE``; ``env`` adds to that. Restarts keep a
    drafter's or verifier's address (its Unix socket); a gateway's port is read back after each start.
    A verifier that serves is asked what it runs (``Stats.setup``): a dtype or backend other than the
    test set fails the test there (``wait_healthy``)."""

    def __init__(
        self, kind: str, env: dict[str, str], log_dir: Path, name: str | None = None, unix: bool | None = None
    ):
        base = dict(OMP_NUM_THREADS="1", RACER_INTERNAL_TOKEN=INTERNAL_TOKEN)
        if kind == "verifier":
            base["RACER_DTYPE"] = DTYPE
        super().__init__(kind, dict(base, **env), log_dir, name, unix)

    def wait_healthy(self, timeout: float = 300.0) -> "Proc":
        super().wait_healthy(timeout)
        if self.kind == "verifier":
            self.check_setup()
        return self

    def setup(self) -> verifier_pb2.VerifierSetup:
        """What the verifier reports it computes with."""
        with grpc.insecure_channel(self.target) as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            return stub.Stats(verifier_pb2.VerifierStatsRequest(), timeout=30, metadata=BACKEND_METADATA).setup

    def check_setup(self) -> None:
        """AssertionError where the verifier runs another dtype or backend than its settings name
        (``auto`` aside): a test must run what it says it runs."""
        got = self.setup()
        for setting, reported in (("RACER_DTYPE", got.dtype), ("RACER_BACKEND", got.backend)):
            wanted = self.env.get(setting, "auto")
            if wanted != "auto" and wanted != reported:
                raise AssertionError(f"{self.name}: {setting}={wanted}, but the verifier reports {reported!r}")

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


class RedisProc(RedisServer):
    """redis-server with an append-only file, so a stop and restart keeps the data (as deployed);
    with ``password``, ``requirepass`` as deployed (``url`` carries it)."""


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
