"""The internal token: every method of a protected server refuses calls without one of its tokens
(unary and streaming alike), health stays open for probes, rotation lists are honoured, and
settings that could not protect anything are refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from common import identity
from common.server import start_server

OLD, NEW = "old-token-0123456789abcdef", "new-token-0123456789abcdef"


def _ident(b: bytes) -> bytes:
    return b


async def _unary(request, context):
    return b"secret: " + request


async def _bidi(requests, context):
    async for r in requests:
        yield r


def _register(server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _ident, _ident),
        "Bidi": grpc.stream_stream_rpc_method_handler(_bidi, _ident, _ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.T", handlers),))


def test_every_method_but_health_needs_one_of_the_tokens():
    async def go():
        srv = await start_server("drafter", _register, port=0, interceptors=[identity.PeerAuthInterceptor((NEW, OLD))])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
                unary = ch.unary_unary("/test.T/Unary", _ident, _ident)
                bidi = ch.stream_stream("/test.T/Bidi", _ident, _ident)
                for md in ((), (("racer-internal-token", "wrong-token-0123456789abcdef"),), (("other", NEW),)):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await unary(b"x", timeout=10, metadata=md)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "secret" not in (e.value.details() or "")
                    # a stream is refused from its metadata alone, before any message: a write here would
                    # race the refusal (a write to a call the server already ended fails locally, as
                    # INTERNAL), so the refused streams are only read
                    call = bidi(timeout=10, metadata=md)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call.read()
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    reflect = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(timeout=10, metadata=md)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await reflect.read()
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                for token in (NEW, OLD):  # both tokens of a rotation are accepted
                    md = identity.metadata((token,))
                    assert await unary(b"x", timeout=10, metadata=md) == b"secret: x"
                    call = bidi(timeout=10, metadata=md)
                    await call.write(b"y")
                    assert await call.read() == b"y"
                    await call.done_writing()
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="racer.v1.Drafter"), timeout=10
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no token
        finally:
            await srv.stop(0)

    asyncio.run(go())


def test_the_health_port_answers_health_alone_in_plaintext_and_flips_on_shutdown():
    async def go():
        srv = await start_server(
            "verifier", _register, port=0, interceptors=[identity.PeerAuthInterceptor((NEW,))], health_port=-1
        )
        port = srv.health_port
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                check = health_pb2_grpc.HealthStub(ch).Check
                reply = await check(health_pb2.HealthCheckRequest(service="racer.v1.Verifier"), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as e:  # nothing else lives on that port
                    await ch.unary_unary("/test.T/Unary", _ident, _ident)(
                        b"x", timeout=10, metadata=identity.metadata((NEW,))
                    )
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
                await srv.health.enter_graceful_shutdown()
                reply = await check(health_pb2.HealthCheckRequest(service="racer.v1.Verifier"), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await srv.stop(0)

    asyncio.run(go())


def test_token_settings():
    assert identity.load_tokens() == ()
    assert identity.load_tokens(f"{NEW}, {OLD}") == (NEW, OLD)
    assert identity.metadata((NEW, OLD)) == (("racer-internal-token", NEW),)
    assert identity.metadata(()) == ()
    for bad in ("short", "has a space in it 0123456789", "ünïcode-token-0123456789"):
        with pytest.raises(ValueError):
            identity.load_tokens(bad)
    with pytest.raises(ValueError, match="no peer authentication"):
        identity.require_peer_auth("drafter", (), "", False)
    identity.require_peer_auth("drafter", (NEW,), "", False)
    identity.require_peer_auth("drafter", (), "ca.pem", False)  # mutual TLS authenticates callers
    identity.require_peer_auth("drafter", (), "", True)  # said explicitly


def test_token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text(NEW + "\n")  # as `kubectl create secret --from-file` or an editor leaves it
    assert identity.load_tokens(path=str(f)) == (NEW,)
    assert identity.load_tokens(OLD, str(f)) == (OLD, NEW)
    with pytest.raises(ValueError, match="--internal-token-file"):
        identity.load_tokens(path=str(tmp_path / "missing"))
