"""OpenAI's Responses API (``/v1/responses``) over the gateway's sessions. No HTTP here
(``openai_http`` is the transport): a request body in, the response object or its stream events out.

State is the service's own sessions. A stored response (``store``, the default) is a point of a
kept session: its id names the session and how many of its tokens the conversation holds up to the
response's output (``responses_store``). ``previous_response_id``:

* names the session's latest point: the turn continues that session, and only the new input is
  tokenized and prefilled (the verifier's cache and the drafter's state carry over). The gateway
  checks, under the session's lease, that the session still holds exactly those tokens
  (``Request.expect_tokens``); if another response continued it first, this one forks instead.
* names an older point (someone continued from it already), or ``store`` is false: a fork, a new
  session whose prompt is the session's tokens up to that point, then the new input: exactly the
  history that point had (the verifier's prefix cache spares most of the prefill).

``store: false`` is a one-call session, closed when its turn ends, as chat without ``session_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable

from common.errors import Abort, Status
from common.logs import log_bug

from .admission import Queued
from .core import Gateway
from .openai_errors import bad_request, model_not_found
from .openai_requests import sampling_fields
from .requests import Request, input_ids
from .responses_bodies import ResponsesBody
from .responses_input import Conversation, Input, Shape, chat_fields, new_id, parse_body, read_input, shape
from .responses_output import Events, Output, failed, finished, head
from .responses_store import ResponseStore, StoredResponse, missing
from .tools import template_for
from .turn import Chunk, Finished

log = logging.getLogger("racer.gateway")


@dataclass(frozen=True)
class Plan:
    """The turn to run, and (a continuation) how to make the fork to run instead if it cannot."""

    request: Request
    fork: Callable[[], Awaitable[Request]] | None = None


class Responses:
    """The API's operations for one gateway and its served model."""

    def __init__(self, gw: Gateway, model: str):
        self.gw = gw
        self.model = model
        self.store = ResponseStore(gw.records)

    async def create(self, tenant: str, body) -> Run:
        """The checked request, its previous response found and its session point chosen; 400, 404
        here, before any turn begins."""
        b = parse_body(body)
        if b.model != self.model:
            raise model_not_found(b.model, self.model)
        prev = None
        if b.previous_response_id is not None:
            prev = await self.store.load(tenant, b.previous_response_id, "previous_response_id")
        instructions = _instructions(b, prev)
        before = Conversation(dict(prev.calls), list(prev.ids)) if prev is not None else Conversation()
        inp = read_input(b, before, prev is not None)
        sh = shape(b, self.gw.tool_parser)
        messages = inp.messages
        if prev is None and instructions:
            messages = [{"role": "system", "content": instructions}] + messages
        base = Request(**chat_fields(messages), **_sampling(b), tools=sh.tools, grammar=sh.grammar)
        plan = await self._plan(tenant, b, prev, base)
        return Run(self, tenant, b, plan, inp, sh, instructions)

    async def _plan(self, tenant: str, b: ResponsesBody, prev: StoredResponse | None, base: Request) -> Plan:
        if prev is None:
            return Plan(base)
        history = await self._history(tenant, prev)
        if base.keep and len(history) == prev.end:  # the session's latest point: continue it
            cont = replace(base, session_id=prev.session_id, expect_tokens=prev.end)
            return Plan(cont, lambda: self._forked(tenant, prev, base))
        return Plan(await self._fork(history[: prev.end], base))

    async def _history(self, tenant: str, prev: StoredResponse) -> list[int]:
        try:
            rec = await self.gw.session(tenant, prev.session_id)
        except Abort as e:
            if e.code is not Status.NOT_FOUND:
                raise
            raise Abort(
                Status.NOT_FOUND,
                f"previous_response_id {prev.id!r}: its conversation's session was closed",
                field="previous_response_id",
            ) from None
        if len(rec.history) < prev.end:
            raise Abort(Status.DATA_LOSS, f"previous_response_id {prev.id!r}: its session holds fewer tokens than it")
        return rec.history

    async def _forked(self, tenant: str, prev: StoredResponse, base: Request) -> Request:
        return await self._fork((await self._history(tenant, prev))[: prev.end], base)

    async def _fork(self, history: list[int], base: Request) -> Request:
        """A new session whose prompt is ``history`` then the new input, tokenized as a kept session's
        next turn would be (the same template, the same continuation of the history)."""
        gw = self.gw
        template = template_for(gw.tokenizer, gw.chat_template, bool(base.tools) or any(base.chat_extra))
        args = (base, history, gw.tokenizer, gw.eos_ids, gw.limits, gw.vocab_size, template)
        new = await asyncio.to_thread(input_ids, *args)
        ids = tuple(history + new)
        return replace(base, session_id="", input="prompt_ids", prompt_ids=ids, chat=(), chat_extra=(), tools="")

    async def get(self, tenant: str, response_id: str, query: dict[str, str]) -> dict:
        if query.get("stream", "false") != "false":
            raise bad_request("stream: resuming a response's stream is not supported by this server", "stream",
                              "unsupported_parameter")  # fmt: skip
        return (await self.store.load(tenant, response_id)).body

    async def delete(self, tenant: str, response_id: str) -> dict:
        """The stored response goes; its session stays until its TTL (``DELETE /v1/sessions/{id}``)."""
        if not await self.store.delete(tenant, response_id):
            raise missing(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, tenant: str, response_id: str) -> dict:
        """Only a background response can be cancelled, and this server runs none: a stored response
        has completed. A 400, as OpenAI answers for a response that was not created in the background."""
        await self.store.load(tenant, response_id)
        raise bad_request(
            f"Response with id {response_id!r}: only responses created with background=true can be cancelled "
            "(this server runs no background responses; a stored response has completed)"
        )

    async def input_items(self, tenant: str, response_id: str, query: dict[str, str]) -> dict:
        items = (await self.store.load(tenant, response_id)).input
        return page(items, query)


def page(items: list[dict], query: dict[str, str]) -> dict:
    """A list page as OpenAI pages them: ``order`` (``desc`` by default), ``after`` an item id, ``limit`` 1-100."""
    order, after, limit = query.get("order", "desc"), query.get("after"), query.get("limit", "20")
    if order not in ("asc", "desc"):
        raise bad_request(f"order: {order[:20]!r}, expected asc or desc", "order")
    if not (limit.isdigit() and 1 <= int(limit) <= 100):
        raise bad_request(f"limit: {limit[:20]!r}, expected 1 to 100", "limit")
    seq = items if order == "asc" else items[::-1]
    ids = [it["id"] for it in seq]
    if after is not None:
        if after not in ids:
            raise bad_request(f"after: {after[:80]!r} is not an item of this response", "after")
        seq = seq[ids.index(after) + 1 :]
    data = seq[: int(limit)]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(seq) > len(data),
    }


def _instructions(b: ResponsesBody, prev: StoredResponse | None) -> str | None:
    """The conversation's instructions: a continuation keeps its conversation's (they are its first
    tokens) and may not change them."""
    if prev is None:
        return b.instructions
    if b.instructions is not None and b.instructions != prev.instructions:
        raise bad_request(
            "instructions: differ from those of the conversation of previous_response_id; this server keeps a "
            "conversation as tokens, the instructions first: start a new conversation to change them",
            "instructions",
        )
    return prev.instructions


def _sampling(b: ResponsesBody) -> dict:
    return sampling_fields(b, b.max_output_tokens or 0) | dict(keep=b.store is not False)


class Run:
    """One ``POST /v1/responses``: its turn, as the whole response object (``whole``) or as stream
    events (``events``)."""

    def __init__(self, api: Responses, tenant: str, b: ResponsesBody, plan: Plan, inp: Input, sh: Shape, instr):
        self.api, self.tenant, self.b, self.plan, self.inp = api, tenant, b, plan, inp
        self.id = new_id("resp")
        self.obj = head(b, self.id, instr)
        self.instructions = instr
        self.ev = Events()
        self.out = Output(sh.parser, sh.parallel, self.ev)
        self.token_ids: list[int] = []
        self.outcome = "OK"  # a stream's outcome (a gRPC status name), for the metrics

    @property
    def stream(self) -> bool:
        return bool(self.b.stream)

    async def whole(self) -> dict:
        async with contextlib.aclosing(self._turn()) as items:
            async for item in items:
                if isinstance(item, Chunk):
                    self._chunk(item)
                elif isinstance(item, Finished):
                    self.out.finish(item.finish_reason == "length")
                    return await self._done(item)
        raise AssertionError("a turn ended without its Finished message")

    async def events(self) -> AsyncIterator[dict | str]:
        """Event objects (and SSE comments while the turn waits for a slot). An error before the turn
        begins is raised before the first event; after it, it ends the stream as ``response.failed``."""
        async with contextlib.aclosing(self._turn()) as items:
            item = await anext(items)
            yield self.ev("response.created", response=self.obj)
            yield self.ev("response.in_progress", response=self.obj)
            try:
                while not isinstance(item, Finished):
                    if isinstance(item, Queued):
                        yield f"queued, {item.ahead} ahead, waited {item.waited_s:.0f} s"
                    else:
                        for e in self._chunk(item):
                            yield e
                    item = await anext(items)
                for e in self.out.finish(item.finish_reason == "length"):
                    yield e
                body = await self._done(item)
                yield self.ev(f"response.{body['status']}", response=body)
            except Abort as e:
                self.outcome = e.code.name
                code = "rate_limit_exceeded" if e.code is Status.RESOURCE_EXHAUSTED else "server_error"
                yield self.ev("response.failed", response=failed(self.obj, self.out, code, e.message))
            except Exception:  # noqa: BLE001 - a bug, after the stream began: logged, then the failed event
                self.outcome = "INTERNAL"
                msg = log_bug(log, "a Responses stream", response_id=self.id)
                yield self.ev("response.failed", response=failed(self.obj, self.out, "server_error", msg))

    def _chunk(self, c: Chunk) -> list[dict]:
        self.token_ids.extend(c.token_ids)
        return self.out.push(c.text)

    async def _done(self, f: Finished) -> dict:
        """The finished response object, stored first (``store``) so that its id can be continued at once."""
        kept = self.plan.request.keep
        body = finished(self.obj, self.out, f, kept, self.token_ids if self.b.return_token_ids else None)
        if not kept:
            return body
        body["session_id"] = f.session_id
        calls = {**self.inp.after.calls, **dict.fromkeys(self.out.call_ids(), False)}
        conv = self.inp.after.then([it["id"] for it in self.out.items], calls)
        stored = StoredResponse(
            id=self.id,
            tenant=self.tenant,
            session_id=f.session_id,
            end=f.session_tokens,
            instructions=self.instructions,
            calls=conv.calls,
            ids=conv.ids,
            input=self.inp.items,
            body=body,
        )
        await self.api.store.save(stored)
        return body

    async def _turn(self) -> AsyncIterator[Queued | Chunk | Finished]:
        """The turn's messages, its ``Finished`` last, once the turn has ended (its streams released)
        and a one-call session is closed. A continuation refused before its first token (ABORTED:
        another turn holds or has moved its session on) runs as a fork instead. Errors name the
        fields as this API does."""
        plan, gw = self.plan, self.api.gw
        req, sid, closed, last = plan.request, None, False, None
        try:
            while True:
                began = False
                try:
                    async with contextlib.aclosing(gw.generate(self.tenant, req)) as items:
                        async for item in items:
                            sid = item.session_id
                            if isinstance(item, Finished):
                                last = item
                                continue
                            began = began or isinstance(item, Chunk)
                            yield item
                    break
                except Abort as e:
                    if began or plan.fork is None or e.code is not Status.ABORTED:
                        raise
                    req, sid = await plan.fork(), None
                    plan = Plan(req)
            if not req.keep:
                closed = True
                await asyncio.shield(asyncio.ensure_future(close_one_call(gw, self.tenant, sid)))
            yield last
        except Abort as e:
            raise _renamed(e) from None
        finally:
            if sid is not None and not req.keep and not closed:
                # an error or a client gone after the turn began: the one-call session still goes
                asyncio.ensure_future(close_one_call(gw, self.tenant, sid))


# The gateway's request fields (``Abort.field``) as this API names them.
_FIELDS = {
    "max_new_tokens": "max_output_tokens",
    "chat": "input",
    "chat.messages": "input",
    "chat.messages.role": "input",
    "prompt_ids": "input",
    "session_id": "previous_response_id",
}


def _renamed(e: Abort) -> Abort:
    field = _FIELDS.get(e.field or "")
    if field is None:
        return e
    message = field + e.message[len(e.field) :] if e.message.startswith(e.field) else e.message
    return Abort(e.code, message, e.retry_after, field)


async def close_one_call(gw: Gateway, tenant: str, session_id: str) -> None:
    """A one-call session goes (a turn that failed saved no record: nothing to close)."""
    try:
        await gw.close(tenant, session_id)
    except Abort as e:
        if e.code is not Status.NOT_FOUND:
            log.warning("closing a one-call session failed", extra={"session_id": session_id, "error": e.message})
