"""Asking a service's ``grpc.health.v1`` whether it serves: once (``racer health``, the container
health check) or until it does (the local stack, the tests)."""

from __future__ import annotations

import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def status(
    target: str, service: str = "", timeout: float = 3.0, credentials: grpc.ChannelCredentials | None = None
) -> str:
    """The serving status's name (``SERVING``, ``NOT_SERVING``...), or the gRPC status's name
    (``UNAVAILABLE``, ``NOT_FOUND``...) when the check itself fails."""
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(
    target: str,
    service: str = "",
    timeout: float = 120.0,
    credentials: grpc.ChannelCredentials | None = None,
    alive: Callable[[], bool] | None = None,
    what: str = "",
) -> None:
    """Polls until ``service`` at ``target`` is SERVING. Raises TimeoutError after ``timeout``
    seconds, or RuntimeError as soon as ``alive()`` says the process behind it has exited."""
    deadline = time.monotonic() + timeout
    name = what or target
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"{name} exited before it served")
        if status(target, service, timeout=1.0, credentials=credentials) == "SERVING":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not healthy after {timeout:g} s")
        time.sleep(0.1)


def main(target: str, service: str = "", credentials: grpc.ChannelCredentials | None = None) -> int:
    """``racer health [HOST:]PORT [SERVICE]``: exit 0 iff SERVICE is SERVING (1 otherwise)."""
    import sys

    target = target if ":" in target else "localhost:" + target
    got = status(target, service, credentials=credentials)
    print(f"{target} {service!r}: {got}", file=sys.stdout if got == "SERVING" else sys.stderr)
    return 0 if got == "SERVING" else 1
