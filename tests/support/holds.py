"""Holding a turn at a known point, however fast or slow the machine: a turn that must still be
running when something happens to it is made unable to finish first, never given a head start
that a faster machine could use up.

* ``held_rounds``: services in this process (``tests/support/stack.py``). Every round an in-process
  verifier core is asked to verify waits on an event: a turn streams its first chunk (the token
  its open gave) and goes no further until the test releases it.
* ``BackendProxy``: services as processes (``tests/support/procs.py``). A gRPC passthrough in this
  process, in front of one drafter or verifier, that a gateway is given as that backend's address.
  It forwards every call, and can hold one session's stream (``Hold``): after its open, the
  session's requests wait in the proxy, so the backend does nothing more for the turn, not even a
  run it would go on with by itself, until the test releases them.

Released, a held stream may go on at a pace: each answer at least ``pace`` seconds after the one
before. That is a lower bound on how long the turn lasts (``n`` rounds: ``n * pace`` seconds at
least), which a faster machine cannot shorten and a slower one only lengthens; it is for what no
event shows, such as the moment a draining gateway stops its turns, which must find the turn
running whatever the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from concurrent import futures
from typing import Iterable, Iterator

import grpc

from common.server import server_options
from common.settings import common_default
from common.v1 import drafter_pb2, verifier_pb2
from racer.procs import socket_dir

# -- services in this process --------------------------------------------------------------------


class RoundHold:
    """Rounds of in-process verifier cores waiting on one event (``held_rounds``)."""

    def __init__(self, lt, sessions: Iterable[str] | None, tenants: Iterable[str] | None):
        self._lt = lt
        self._sessions = None if sessions is None else set(sessions)
        self._tenants = None if tenants is None else set(tenants)
        self._go = asyncio.Event()  # set on the loop only (``release``)
        self._held: set[str] = set()  # written on the loop, read by the test
        self.reached = threading.Event()  # a round waits

    def holds(self, entry) -> bool:
        return (self._sessions is None or entry.session_id in self._sessions) and (
            self._tenants is None or entry.tenant in self._tenants
        )

    async def wait(self, entry) -> None:
        if self.holds(entry) and not self._go.is_set():
            self._held.add(entry.session_id)
            self.reached.set()
            await self._go.wait()

    @property
    def held(self) -> frozenset[str]:
        """The sessions that had a round wait."""
        return frozenset(self._held)

    def release(self) -> None:
        """The waiting rounds go on, and no later one waits."""
        self._lt.loop.call_soon_threadsafe(self._go.set)


@contextlib.contextmanager
def held_rounds(
    lt, cores, sessions: Iterable[str] | None = None, tenants: Iterable[str] | None = None
) -> Iterator[RoundHold]:
    """Inside, every round (a tree, or a run's first round) the verifier cores ``cores`` (in this
    process, on ``lt``'s loop) are asked to verify for the ``sessions`` of the ``tenants`` (None: any)
    waits until ``release()`` (at the latest on leaving): a turn's open is answered, its first chunk
    goes out, and the turn can go no further, however fast the machine. A held round's stream that
    ends (cancelled, closed) ends as it would in a forward. Yields the ``RoundHold``."""
    hold = RoundHold(lt, sessions, tenants)
    cores = list(cores)
    for core in cores:
        original = core.verify

        async def verify(entry, *args, _original=original, **kwargs):
            await hold.wait(entry)
            return await _original(entry, *args, **kwargs)

        core.verify = verify  # the instance's attribute: what its streams call
    try:
        yield hold
    finally:
        hold.release()
        for core in cores:
            del core.verify


# -- services as processes ------------------------------------------------------------------------

_SESSION = {
    "/racer.v1.Verifier/Session": verifier_pb2.VerifyRequest,
    "/racer.v1.Drafter/Session": drafter_pb2.DraftRequest,
}


class Hold:
    """One session's stream through a ``BackendProxy``: its open (the first request) goes through, its
    later requests wait in the proxy until ``release``. ``waiting`` is set once one of them waits:
    the turn has had its open answered (its first chunk is out) and goes no further meanwhile."""

    def __init__(self, session_id: str | None):
        self.session_id = session_id  # None: the first session opened after the hold was made
        self.waiting = threading.Event()
        self.pace = 0.0  # seconds between two answers, once released
        self._released = False
        self._cv = threading.Condition()
        self._last = 0.0

    def release(self, pace: float = 0.0) -> None:
        """The waiting requests go on, and every later one; with ``pace``, each answer leaves at least
        ``pace`` seconds after the one before (the session's turn keeps going, slowly)."""
        with self._cv:
            self.pace = pace
            self._released = True
            self._cv.notify_all()

    def _pass(self, ended: threading.Event) -> bool:
        """A request of the session may go on (False: the call ended while it waited)."""
        with self._cv:
            if not self._released:
                self.waiting.set()
            while not self._released and not ended.is_set():
                self._cv.wait()
            return not ended.is_set()

    def _claims(self, session_id: str) -> bool:
        """Whether the stream of ``session_id`` is this hold's (one made for any session takes the first)."""
        with self._cv:
            if self.session_id is None:
                self.session_id = session_id
            return self.session_id == session_id

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _answer(self) -> None:
        """Before an answer of the session leaves (after the open's): the pace, once released."""
        if self.pace:
            now = time.monotonic()
            if now < self._last + self.pace:
                time.sleep(self._last + self.pace - now)
            self._last = time.monotonic()


@contextlib.contextmanager
def holding(proxies: Iterable["BackendProxy"], session_id: str | None = None) -> Iterator[Hold]:
    """Inside, the stream of ``session_id`` (None: the first session opened from now on) is held after
    its open on whichever of ``proxies`` it opens (``Hold``; one hold for all: a session that moves to
    another backend once released is not held there); on leaving, it is released and forgotten."""
    h = Hold(session_id)
    proxies = list(proxies)
    for p in proxies:
        p._add(h)
    try:
        yield h
    finally:
        for p in proxies:
            p._remove(h)
        h.release()


class BackendProxy:
    """A passthrough in this process, on a Unix socket of its own (``target``), to the drafter or
    verifier at ``upstream``. Every call is forwarded: the caller's metadata, deadline and messages,
    the backend's answers, status and trailing metadata, and a cancel either way; so a gateway given
    ``target`` works as with the backend itself (a dead backend is UNAVAILABLE, a frozen one does not
    answer, a draining one refuses as draining). Not what the backend's own keepalive would notice
    of the gateway: a test of that reaches the backend directly. ``hold`` holds a session's stream
    (``Hold``). ``keepalive_seconds``: the proxy's as a server, as the backend's (a gateway pings it
    as often as it pings a backend)."""

    def __init__(self, upstream: str, keepalive_seconds: float = common_default("--keepalive-seconds")):
        self.upstream = upstream
        self.socket = socket_dir() / f"proxy-{os.getpid()}-{id(self):x}.sock"
        self.target = f"unix:{self.socket}"
        self._keepalive = keepalive_seconds
        self._holds: list[Hold] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None

    def start(self) -> "BackendProxy":
        size = int(common_default("--max-message-bytes"))
        self._channel = grpc.insecure_channel(
            self.upstream,
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                # a restarted backend is used again as soon as it listens (as the gateway's channels)
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="proxy"),
            handlers=[_Forward(self)],
            options=server_options(size, self._keepalive),
        )
        if not self._server.add_insecure_port(self.target):
            raise RuntimeError(f"proxy: cannot bind {self.target}")
        self._server.start()
        return self

    def stop(self) -> None:
        with self._lock:
            holds, self._holds = self._holds, []
        for h in holds:
            h.release()
        if self._server is not None:
            self._server.stop(0).wait(10)
        if self._channel is not None:
            self._channel.close()

    def hold(self, session_id: str | None = None):
        """``holding([self], session_id)``."""
        return holding([self], session_id)

    def _add(self, h: Hold) -> None:
        with self._lock:
            self._holds.append(h)

    def _remove(self, h: Hold) -> None:
        with self._lock:
            if h in self._holds:
                self._holds.remove(h)

    def _claim(self, session_id: str) -> Hold | None:
        with self._lock:
            holds = list(self._holds)
        for h in holds:  # a hold of this very session first
            if h.session_id == session_id:
                return h
        for h in holds:
            if h._claims(session_id):
                return h
        return None

    def _forward(self, method: str, requests, context):
        metadata = [(k, v) for k, v in context.invocation_metadata() if k != "user-agent" and not k.startswith(":")]
        ended = threading.Event()
        hold: list[Hold] = []  # the stream's, once its open is read

        def upstream_requests():
            for i, req in enumerate(requests):
                if i == 0 and method in _SESSION:
                    sid = _SESSION[method].FromString(req).open.session_id
                    h = self._claim(sid) if sid else None
                    if h is not None:
                        hold.append(h)
                elif hold and not hold[0]._pass(ended):
                    return
                yield req

        remaining = context.time_remaining()  # a call without a deadline: a huge figure
        call = self._channel.stream_stream(method)(
            upstream_requests(), metadata=metadata, timeout=remaining if remaining < 86400 else None
        )

        def on_end():
            ended.set()
            call.cancel()
            if hold:
                hold[0]._wake()

        if not context.add_callback(on_end):  # it ended already
            on_end()
        try:
            for i, resp in enumerate(call):
                if i > 0 and hold:
                    hold[0]._answer()
                yield resp
            context.set_trailing_metadata(_metadata(call.trailing_metadata()))
        except grpc.RpcError as e:
            if context.is_active():
                context.set_trailing_metadata(_metadata(e.trailing_metadata()))
                context.abort(e.code(), e.details() or "")


def _metadata(md) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in (md or ()) if not k.startswith(":")]


class _Forward(grpc.GenericRpcHandler):
    """Every method, as a stream of bytes each way (on the wire, a unary call is a stream of one)."""

    def __init__(self, proxy: BackendProxy):
        self.proxy = proxy

    def service(self, handler_call_details):
        method = handler_call_details.method
        return grpc.stream_stream_rpc_method_handler(
            lambda requests, context: self.proxy._forward(method, requests, context)
        )
