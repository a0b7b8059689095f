"""The server skeleton's error interceptor: Abort becomes the status it names, for every handler
style, and handlers it does not know (grpc's own health Watch) keep working."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import Abort, Status
from common.server import start_server


def _ident(b: bytes) -> bytes:
    return b


async def _unary(request, context):
    raise Abort(Status.NOT_FOUND, "session_id 'x': no such session")


async def _stream(request, context):
    yield b"first"
    raise Abort(Status.FAILED_PRECONDITION, "tree: open the session first")


async def _bidi(requests, context):
    async for r in requests:
        if r == b"bad":
            raise Abort(Status.INVALID_ARGUMENT, "request: set one of open, tree")
        yield r


def _register(server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _ident, _ident),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, _ident, _ident),
        "Bidi": grpc.stream_stream_rpc_method_handler(_bidi, _ident, _ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.T", handlers),))


@contextlib.asynccontextmanager
async def _serving(register):
    """A server with ``register``'s handlers on a free port, and a channel to it."""
    srv = await start_server("drafter", register, port=0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            yield ch
    finally:
        await srv.stop(0)


async def _bidi_error(ch) -> grpc.aio.AioRpcError:
    """The Bidi handler echoes b"ok", then fails on b"bad": the error its client reads."""
    bidi = ch.stream_stream("/test.T/Bidi", _ident, _ident)(timeout=10)
    await bidi.write(b"ok")
    assert await bidi.read() == b"ok"
    await bidi.write(b"bad")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await bidi.read()
    return e.value


def test_abort_becomes_its_status_in_every_handler_style_and_health_watch_still_streams():
    async def go():
        async with _serving(_register) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/test.T/Unary", _ident, _ident)(b"x", timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no such session" in e.value.details()

            call = ch.unary_stream("/test.T/Stream", _ident, _ident)(b"x", timeout=10)
            assert await call.read() == b"first"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            assert (await _bidi_error(ch)).code() == grpc.StatusCode.INVALID_ARGUMENT

            # grpc's health Watch sends with context.write and yields nothing
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()

    asyncio.run(go())


SECRET = "password=hunter2 at /srv/app/internal.py"


async def _unary_bug(request, context):
    raise KeyError(SECRET)


async def _stream_bug(request, context):
    yield b"first"
    raise RuntimeError(SECRET)


async def _bidi_bug(requests, context):
    async for r in requests:
        if r == b"bad":
            raise TypeError(SECRET)
        yield r


async def _coroutine_stream_bug(request, context):  # the health Watch style: writes, returns nothing
    await context.write(b"first")
    raise ValueError(SECRET)


def _register_bugs(server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary_bug, _ident, _ident),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream_bug, _ident, _ident),
        "Bidi": grpc.stream_stream_rpc_method_handler(_bidi_bug, _ident, _ident),
        "Writes": grpc.unary_stream_rpc_method_handler(_coroutine_stream_bug, _ident, _ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.T", handlers),))


def test_an_unexpected_exception_is_internal_without_details_and_logged(caplog):
    def check(e):
        assert e.code() == grpc.StatusCode.INTERNAL, e.details()
        assert "internal error" in e.details() and "hunter2" not in e.details() and "Error" not in e.details()

    async def go():
        async with _serving(_register_bugs) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/test.T/Unary", _ident, _ident)(b"x", timeout=10)
            check(e.value)
            for name in ("Stream", "Writes"):
                call = ch.unary_stream(f"/test.T/{name}", _ident, _ident)(b"x", timeout=10)
                assert await call.read() == b"first"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()
                check(e.value)
            e = await _bidi_error(ch)
            check(e)
            return e.details()

    with caplog.at_level("ERROR", logger="racer"):
        details = asyncio.run(go())
    logged = [r for r in caplog.records if r.getMessage() == "unhandled exception in an RPC handler"]
    assert len(logged) == 4 and all(r.exc_info for r in logged)
    assert logged[-1].error_id in details and logged[-1].method == "/test.T/Bidi"
    assert SECRET in str(logged[-1].exc_info[1])
