"""The three services in this process, on an event loop of their own (``LoopThread``), over real gRPC
on loopback: ``start_stack`` starts verifiers, drafters and a gateway on ports the OS picks, over a
model already in memory (no tokenizer: clients send token ids). What the services tests and the
scripts that measure the pipeline's own cost run on.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from dataclasses import dataclass, field

import grpc

from common import identity
from common.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from .. import launch as services

# The internal token of the stacks and processes this test process starts (drafters and verifiers
# refuse calls without it); tests that call a backend directly send ``BACKEND_METADATA``, as an
# operator with the Secret would.
INTERNAL_TOKEN = secrets.token_urlsafe(32)
BACKEND_METADATA = identity.metadata((INTERNAL_TOKEN,))


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 600):
        """``timeout`` guards against a hang only: a stack's start-up tunes kernels, which on a loaded
        two-core machine can take minutes."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Stack:
    """Started services; ``gateway`` is the target clients use."""

    lt: LoopThread
    drafters: list = field(default_factory=list)  # (server, service)
    verifiers: list = field(default_factory=list)
    gateway_pair: tuple | None = None

    @property
    def gateway(self) -> str:
        return self.gateway_pair[0].address

    def drafter_target(self, i: int) -> str:
        return self.drafters[i][0].address

    def verifier_target(self, i: int = 0) -> str:
        return self.verifiers[i][0].address

    def drafter_sessions(self, i: int):
        with grpc.insecure_channel(self.drafter_target(i)) as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            return list(stub.Stats(drafter_pb2.DrafterStatsRequest(), timeout=10, metadata=BACKEND_METADATA).sessions)

    def verifier_sessions(self, i: int = 0):
        with grpc.insecure_channel(self.verifier_target(i)) as ch:
            return list(
                verifier_pb2_grpc.VerifierStub(ch)
                .Stats(verifier_pb2.VerifierStatsRequest(), timeout=10, metadata=BACKEND_METADATA)
                .sessions
            )

    def another_gateway(self, vocab_size: int, **settings):
        """One more gateway (a second replica) over this stack's first drafter and verifier, with the
        shared internal token; ``settings``: its own (session_url, api_keys, quotas...). (server, core)."""
        settings = dict(drafters=self.drafter_target(0), verifiers=self.verifier_target(0), **settings)
        return start_gateway(self.lt, vocab_size, internal_token=INTERNAL_TOKEN, **settings)

    def stop_drafter(self, i: int, grace: float = 0.0):
        self.lt.run(self.drafters[i][0].stop(grace))

    def stop(self):
        servers = [p[0] for p in self.drafters + self.verifiers] + ([self.gateway_pair[0]] if self.gateway_pair else [])
        for srv in servers:
            self.lt.run(srv.stop(0))
        for _, svc in self.verifiers:
            svc.close()


def start_drafter(lt: LoopThread, **settings):
    """One drafter on a free port of 127.0.0.1, without a prior; ``settings``: its own. (server, core)."""
    args = services.defaults("drafter", host="127.0.0.1", port=0, **dict({"prior": "none"}, **settings))
    return lt.run(services.start_drafter(args))


def start_gateway(lt: LoopThread, vocab_size: int, **settings):
    """One gateway on a free port of 127.0.0.1 that loads no tokenizer; ``settings``: its own (its
    drafters and verifiers among them). (server, core)."""
    args = services.defaults("gateway", host="127.0.0.1", port=0, model="none", **settings)
    return lt.run(services.start_gateway(args, vocab_size=vocab_size))


def start_stack(
    lt: LoopThread,
    model,
    *,
    drafters: int = 1,
    verifiers: int = 1,
    snapshot_url: str = "memory://",
    session_url: str = "memory://",
    api_keys: str = "",
    tokenizer=None,
    eos_ids=(),
    snapshot_every: int = 32,
    backend: dict | None = None,
    verifier: dict | None = None,
    **gateway,
) -> Stack:
    """``backend``: settings for the drafters and verifiers, ``verifier``: for the verifiers alone; the
    other keywords are the gateway's.
    All of them share ``INTERNAL_TOKEN`` unless ``internal_token`` is given (to both)."""
    st = Stack(lt)
    backend = dict(backend or {})
    backend.setdefault("internal_token", gateway.get("internal_token", INTERNAL_TOKEN))
    gateway.setdefault("internal_token", backend["internal_token"])

    async def go():
        for _ in range(verifiers):
            st.verifiers.append(
                await services.start_verifier(
                    services.defaults(
                        "verifier",
                        host="127.0.0.1",
                        port=0,
                        # every prompt row's top-k (the prompts here are short): the bound a verifier
                        # measures otherwise (``verifier.engine.measure_prompt_rows``) follows the machine
                        **dict({"max_sessions": 16, "prompt_topk": -1}, **backend, **(verifier or {})),
                    ),
                    model=model,
                )
            )
        for _ in range(drafters):
            st.drafters.append(
                await services.start_drafter(
                    services.defaults(
                        "drafter",
                        host="127.0.0.1",
                        port=0,
                        snapshot_url=snapshot_url,
                        prior="none",
                        snapshot_every=snapshot_every,
                        **backend,
                    )
                )
            )
        args = services.defaults(
            "gateway",
            host="127.0.0.1",
            port=0,
            model="none",
            session_url=session_url,
            api_keys=api_keys,
            drafters=",".join(f"127.0.0.1:{s.port}" for s, _ in st.drafters),
            verifiers=",".join(f"127.0.0.1:{s.port}" for s, _ in st.verifiers),
            **gateway,
        )
        st.gateway_pair = await services.start_gateway(
            args, tokenizer=tokenizer, eos_ids=eos_ids, vocab_size=model.config.vocab_size
        )

    lt.run(go())
    return st
