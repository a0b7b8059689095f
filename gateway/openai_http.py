"""The OpenAI-compatible HTTP API: aiohttp in the gateway's own event loop, over the core.

Like ``service.py`` for gRPC, this is a thin transport: a handler reads the HTTP request,
``openai_requests`` turns its JSON into the gateway's ``Request``, ``Gateway.generate`` runs the turn,
and ``openai_responses`` shapes the answer, which goes back as JSON or as server-sent events
(``data: {...}`` lines, then ``data: [DONE]``). ``Abort`` becomes an OpenAI error object
(``openai_errors``) with the HTTP status of its gRPC code.

aiohttp's ``AppRunner`` runs on the loop it is started from (no thread, no signal handlers of its
own), so a turn served over HTTP shares admission, limits, metrics and drain with the gRPC ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from aiohttp import web

from common.errors import Abort
from common.logs import log_bug

from . import metrics as M
from . import openai_responses as responses
from .admission import Queued
from .core import Gateway
from .openai_errors import ApiError, bad_request, from_abort, model_not_found
from .openai_requests import Call, parse
from .responses_api import Responses, close_one_call
from .stops import StopText
from .tools import StreamParser, ToolCall
from .turn import Chunk, Finished

log = logging.getLogger("racer.gateway")

SESSION_HEADER = "X-Session-Id"
_GATEWAY = web.AppKey("gateway", Gateway)
_MODEL = web.AppKey("model", str)
_CREATED = web.AppKey("created", int)
_RESPONSES = web.AppKey("responses", Responses)


def _error(e: ApiError) -> web.Response:
    return web.json_response(e.body, status=e.status, headers=e.headers)


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error leaves as an OpenAI error object: the API's own, the core's ``Abort``, aiohttp's
    (unknown path, wrong method, a body over the size limit) and a bug (500 with a log id)."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error(e)
    except Abort as e:
        return _error(from_abort(e))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        return _error(ApiError(e.status, e.reason, "invalid_request_error", None, code))
    except Exception:  # noqa: BLE001 - a bug: logged with an id, nothing of it to the caller
        return _error(_internal(request))


def _internal(request: web.Request) -> ApiError:
    """The bug being handled, logged with an id (``common.logs.log_bug``), as the caller's error."""
    return ApiError(500, log_bug(log, "an HTTP handler", path=request.path), "server_error")


def _tenant(request: web.Request) -> str:
    return request.app[_GATEWAY].tenant(request.headers.items())


async def _models(request: web.Request) -> web.Response:
    _tenant(request)
    return web.json_response(responses.models(request.app[_MODEL], request.app[_CREATED]))


async def _model(request: web.Request) -> web.Response:
    _tenant(request)
    name = request.match_info["model"]
    if name != request.app[_MODEL]:
        raise model_not_found(name, request.app[_MODEL])
    return web.json_response(responses.model(name, request.app[_CREATED]))


async def _close_session(request: web.Request) -> web.Response:
    gw = request.app[_GATEWAY]
    rec = await gw.close(_tenant(request), request.match_info["session_id"])
    return web.json_response({"id": rec.session_id, "object": "session", "deleted": True})


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    gw = request.app[_GATEWAY]
    tenant = _tenant(request)
    body = _json(await request.read())
    call = parse(body, chat, request.headers.get(SESSION_HEADER, ""), gw.tool_parser)
    if call.model != request.app[_MODEL]:
        raise model_not_found(call.model, request.app[_MODEL])
    closing: list[asyncio.Future] = []  # the one-call session's close, once started
    started: list[str] = []  # the turn's session id, once known

    async def done(session_id: str) -> None:
        """After the turn and before the answer's last bytes: a one-call session is closed."""
        if not call.keep_session and not closing:
            closing.append(asyncio.ensure_future(close_one_call(gw, tenant, session_id)))
            await asyncio.shield(closing[0])

    try:
        with M.generate_call() as outcome:
            async with contextlib.aclosing(gw.generate(tenant, call.request)) as items:
                # The first item (or the error before it) decides the status line: errors a turn
                # meets at its start are plain HTTP errors, for streams too. A stream whose turn
                # waits for a slot (``Queued``) starts at once, to keep the connection alive.
                first = await anext(items)
                started.append(first.session_id)
                if call.stream:
                    resp, outcome[0] = await _stream(request, call, first, items, done)
                    return resp
                return await _whole(call, first, items, done, responses.Tokens(call, gw.tokenizer))
    finally:
        if started and not call.keep_session and not closing:
            # An error or a client gone after the turn began (its record may have been saved just
            # before): the one-call session still goes, in a task of its own, whatever cancelled this.
            closing.append(asyncio.ensure_future(close_one_call(gw, tenant, started[0])))


async def _create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (``responses_api``): the response object, or its events as server-sent
    events (``event: <type>`` and ``data: {...}``, no ``[DONE]``, as OpenAI sends them)."""
    tenant = _tenant(request)
    run = await request.app[_RESPONSES].create(tenant, _json(await request.read()))
    with M.generate_call() as outcome:
        if not run.stream:
            return web.json_response(await run.whole())
        async with contextlib.aclosing(run.events()) as events:
            first = await anext(events)  # the turn has begun: an error before it is a plain HTTP error
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            await resp.write(_sse(first))
            async for ev in events:
                await resp.write(_sse(ev))
            await resp.write_eof()
            outcome[0] = run.outcome
            return resp


def _sse(ev: dict | str) -> bytes:
    """An event object as its server-sent event; a string as a comment (clients skip it)."""
    if isinstance(ev, str):
        return f": {ev}\n\n".encode()
    return f"event: {ev['type']}\n".encode() + _event(ev)


async def _get_response(request: web.Request) -> web.Response:
    api, tenant = request.app[_RESPONSES], _tenant(request)
    return web.json_response(await api.get(tenant, request.match_info["response_id"], dict(request.query)))


async def _delete_response(request: web.Request) -> web.Response:
    api, tenant = request.app[_RESPONSES], _tenant(request)
    return web.json_response(await api.delete(tenant, request.match_info["response_id"]))


async def _cancel_response(request: web.Request) -> web.Response:
    api, tenant = request.app[_RESPONSES], _tenant(request)
    return web.json_response(await api.cancel(tenant, request.match_info["response_id"]))


async def _response_input_items(request: web.Request) -> web.Response:
    api, tenant = request.app[_RESPONSES], _tenant(request)
    return web.json_response(await api.input_items(tenant, request.match_info["response_id"], dict(request.query)))


def _json(raw: bytes):
    """The body as JSON (RFC 8259: UTF-8); whatever it holds, a 400 if it is not JSON this server reads."""
    try:
        body = json.loads(raw.decode("utf-8"))
        if b"\\u" in raw:  # an escape may be a lone surrogate: no text to tokenize
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        return body
    except UnicodeEncodeError:
        raise bad_request(
            "the request body is not valid JSON text: it holds a lone surrogate (\\ud800-\\udfff)"
        ) from None
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and an integer of more digits than Python converts
        raise bad_request(f"the request body is not valid JSON: {e}") from None


async def _rest(items) -> None:
    """Runs the turn to its end after its ``Finished`` (it releases its streams there): closing it
    early would cancel that release."""
    async for item in items:
        raise AssertionError(f"a turn went on after its Finished message: {item!r}")


async def _whole(call: Call, first, items, done, tokens: responses.Tokens) -> web.Response:
    text = StopText(call.stop)
    parts: list[str] = []
    ids: list[int] = []
    logprobs: list[dict] = []
    echoed = ""
    item = first
    while isinstance(item, Queued):  # no keep-alive without a stream: the status line waits for the turn
        item = await anext(items)
    while isinstance(item, Chunk):
        if item.echo_ids is not None:  # completions' echo: the prompt first
            prompt, lp = tokens.echo(item.echo_ids, item.echo)
            echoed = prompt
            if lp is not None:
                logprobs.append(lp)
        parts.append(text.push(item.text))
        ids.extend(item.token_ids)
        lp = tokens.entries(item.token_ids, item.logprobs)
        if lp is not None:
            logprobs.append(lp)
        item = await anext(items)
    assert isinstance(item, Finished)
    await _rest(items)
    await done(item.session_id)
    parts.append(text.flush())
    body = responses.response(
        call, item, echoed + "".join(parts), responses.finish_reason(item, text), ids, responses.Tokens.join(logprobs)
    )
    return web.json_response(body, headers={SESSION_HEADER: item.session_id} if call.keep_session else None)


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _event_stream(request: web.Request, call: Call, session_id: str) -> web.StreamResponse:
    """The server-sent events' response, its status line and headers sent."""
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            **({SESSION_HEADER: session_id} if call.keep_session else {}),
        }
    )
    await resp.prepare(request)
    return resp


async def _stream(request: web.Request, call: Call, first, items, done) -> tuple[web.StreamResponse, str]:
    """Server-sent events; an error after the status line was sent travels as an event (the openai
    client raises it). Returns the response and the turn's outcome (a gRPC status name)."""
    resp = await _event_stream(request, call, first.session_id)
    sid = first.session_id
    text = StopText(call.stop)
    tokens = responses.Tokens(call, request.app[_GATEWAY].tokenizer)
    calls = _Calls(call, sid, resp) if call.tool_parser else None
    code = "OK"
    try:
        item = first
        while isinstance(item, Queued):
            # An SSE comment while the turn waits for a slot: clients ignore it, and proxies and
            # clients with read timeouts see a live stream.
            await resp.write(f": queued, {item.ahead} ahead, waited {item.waited_s:.0f} s\n\n".encode())
            item = await anext(items)
        if call.chat:
            await resp.write(_event(responses.chunk(call, sid, None, [])))
        while isinstance(item, Chunk):
            if item.echo_ids is not None:  # completions' echo: the prompt first
                prompt, lp = tokens.echo(item.echo_ids, item.echo)
                await resp.write(_event(responses.chunk(call, sid, prompt, [], logprobs=lp)))
            delta = text.push(item.text)
            lp = tokens.entries(item.token_ids, item.logprobs)
            if calls is not None:
                await calls.push(delta, item.token_ids, lp)
            elif delta or call.return_token_ids or lp is not None:
                await resp.write(_event(responses.chunk(call, sid, delta, item.token_ids, logprobs=lp)))
            item = await anext(items)
        assert isinstance(item, Finished)
        await _rest(items)
        await done(item.session_id)
        rest = text.flush()
        reason = responses.finish_reason(item, text)
        if calls is not None:
            await calls.push(rest, [], None, final=True)
            if calls.index and reason == "stop":
                reason = "tool_calls"
        elif rest:
            await resp.write(_event(responses.chunk(call, sid, rest, [])))
        await resp.write(_event(responses.last_chunk(call, item, reason)))
        if call.include_usage:
            await resp.write(_event(responses.usage_chunk(call, item)))
    except Abort as e:
        code = e.code.name
        await resp.write(_event(from_abort(e).body))
    except ConnectionResetError:  # the client is gone: nothing to tell it
        raise
    except Exception:  # noqa: BLE001 - a bug, after the status line: logged, then an error event
        code = "INTERNAL"
        await resp.write(_event(_internal(request).body))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp, code


class _Calls:
    """A stream whose text is read for tool calls: content deltas as they come, each call once it is
    whole (its first delta with index, id, type and name, then its argument fragments)."""

    def __init__(self, call: Call, sid: str, resp: web.StreamResponse):
        self.call, self.sid, self.resp = call, sid, resp
        self.parser = StreamParser(call.tool_parser)
        self.index = 0  # calls sent

    async def push(self, delta: str, token_ids: list[int], logprobs: dict | None, final: bool = False) -> None:
        out = self.parser.push(delta) if delta else []
        if final:
            out += self.parser.flush()
        if logprobs is not None or (self.call.return_token_ids and token_ids):
            # the tokens' own event (their text goes out below, as content or as a call)
            await self.resp.write(_event(responses.chunk(self.call, self.sid, "", token_ids, logprobs=logprobs)))
        for it in out:
            if isinstance(it, ToolCall):
                if self.index and not self.call.parallel_tool_calls:
                    continue
                for ev in responses.tool_call_chunks(self.call, self.sid, self.index, it):
                    await self.resp.write(_event(ev))
                self.index += 1
            else:
                await self.resp.write(_event(responses.chunk(self.call, self.sid, it, [])))


def app(gateway: Gateway, model: str, max_body_bytes: int) -> web.Application:
    a = web.Application(middlewares=[_errors], client_max_size=max_body_bytes)
    a[_GATEWAY] = gateway
    a[_MODEL] = model
    a[_CREATED] = int(time.time())
    a.router.add_post("/v1/chat/completions", _chat)
    a.router.add_post("/v1/completions", _completions)
    a.router.add_get("/v1/models", _models)
    a.router.add_get("/v1/models/{model}", _model)
    a.router.add_delete("/v1/sessions/{session_id}", _close_session)
    a[_RESPONSES] = Responses(gateway, model)
    a.router.add_post("/v1/responses", _create_response)
    a.router.add_get("/v1/responses/{response_id}", _get_response)
    a.router.add_delete("/v1/responses/{response_id}", _delete_response)
    a.router.add_post("/v1/responses/{response_id}/cancel", _cancel_response)
    a.router.add_get("/v1/responses/{response_id}/input_items", _response_input_items)
    return a


class HttpServer:
    """The API on ``host:port`` in the running event loop; ``port`` is the bound one (0 picks one)."""

    def __init__(self, runner: web.AppRunner, port: int):
        self.runner = runner
        self.port = port

    async def stop(self) -> None:
        """Closes the listener and the connections; run after the gateway's drain ended its turns."""
        await self.runner.cleanup()


async def start_http(gateway: Gateway, host: str, port: int, model: str, max_body_bytes: int) -> HttpServer:
    # handler_cancellation: a client that goes away cancels its turn (and frees its backends).
    runner = web.AppRunner(
        app(gateway, model, max_body_bytes), access_log=None, handler_cancellation=True, shutdown_timeout=1.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    log.info("serving", extra={"service": "gateway-http", "port": bound, "model": model})
    return HttpServer(runner, bound)
