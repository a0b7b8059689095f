"""The shape of a backend's ``Session`` stream, written once for the drafter and the verifier.

Both streams are the same conversation: the first message opens a session (``open``), each later
one is answered by the handler of its kind (the request's ``kind`` oneof), and the session the
stream holds is released when the stream ends, however it ends (the client left, a handler raised,
the server stopped). A draining service refuses each message that arrives (``UNAVAILABLE``,
starting with ``common.errors.DRAINING``) and answers those already taken. A servicer writes only
its handlers: protobuf in, the core, protobuf out.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, ClassVar, Generic, Mapping, TypeVar

from .errors import Abort, Status, check, draining

E = TypeVar("E")  # the core's entry for a session the stream holds

# a message of one kind -> its response, or an async generator of its responses (several answer it)
Handler = Callable[[Any], Awaitable[Any] | AsyncIterator[Any]]


class SessionStream(Generic[E]):
    """One ``Session`` stream. ``serve`` runs the conversation; a subclass gives ``open``, the other
    handlers and ``release``, and may add what happens before a refusal and after each response."""

    service: ClassVar[str]  # "drafter" or "verifier": named in the draining refusal

    def __init__(self) -> None:
        self.entry: E | None = None  # the session this stream holds, from the moment it holds it

    async def open(self, msg) -> Any:
        """Opens the session, setting ``entry`` as soon as the core hands one over (so that a failure
        after that still releases it); the response."""
        raise NotImplementedError

    def handlers(self) -> Mapping[str, Handler]:
        """The other kinds of message, by their oneof field name, and their handlers."""
        raise NotImplementedError

    def release(self, entry: E) -> None:
        """The stream ended: the core takes the session back."""
        raise NotImplementedError

    def draining(self) -> bool:
        return False

    async def before_refusal(self) -> None:
        """What a draining service does before it refuses a message (the drafter saves snapshots)."""

    def responded(self) -> None:
        """After each response went out: work kept off the round's critical path."""

    async def serve(self, requests: AsyncIterable) -> AsyncIterator:
        """The responses to ``requests``: one for each message, or those its handler yields."""
        handlers = self.handlers()
        kinds = ", ".join(("open", *handlers))
        try:
            async for req in requests:
                if self.draining():
                    await self.before_refusal()
                    raise draining(self.service)
                kind = req.WhichOneof("kind")
                if kind == "open":
                    check(self.entry is None, Status.FAILED_PRECONDITION, "open: this stream already has a session")
                    yield await self.open(req.open)
                elif kind in handlers:
                    check(self.entry is not None, Status.FAILED_PRECONDITION, f"{kind}: open the session first")
                    out = handlers[kind](getattr(req, kind))
                    if not inspect.isasyncgen(out):
                        yield await out
                    else:  # a handler that answers one message with several responses
                        async with contextlib.aclosing(out) as responses:
                            async for resp in responses:
                                yield resp
                                self.responded()
                        continue
                else:
                    raise Abort(Status.INVALID_ARGUMENT, f"request: set one of {kinds}")
                self.responded()
        finally:
            if self.entry is not None:
                self.release(self.entry)
