"""The shape both backends' Session streams share: open first and once, a handler per kind, the
session released however the stream ends, messages refused while draining."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from common.errors import DRAINING, Abort, Status
from common.session_stream import SessionStream


class Req:
    """A request with a ``kind`` oneof, as the generated messages have."""

    def __init__(self, kind: str | None, body=None):
        self.kind = kind
        if kind is not None:
            setattr(self, kind, body)

    def WhichOneof(self, name):
        assert name == "kind"
        return self.kind


class Stream(SessionStream[str]):
    service = "drafter"

    def __init__(self, fail_open_after_claim=False, fail_step=False):
        super().__init__()
        self.log: list[str] = []
        self.is_draining = False
        self.fail_open_after_claim, self.fail_step = fail_open_after_claim, fail_step

    def handlers(self):
        return {"step": self.step}

    async def open(self, msg):
        self.entry = f"entry-{msg}"
        if self.fail_open_after_claim:
            raise Abort(Status.DEADLINE_EXCEEDED, "prefill took too long")
        return f"opened {msg}"

    async def step(self, msg):
        if self.fail_step:
            raise RuntimeError("a bug")
        return f"step {msg} on {self.entry}"

    def release(self, entry):
        self.log.append(f"release {entry}")

    def draining(self):
        return self.is_draining

    async def before_refusal(self):
        self.log.append("flush")

    def responded(self):
        self.log.append("responded")


async def _requests(reqs):
    for r in reqs:
        yield r


def _serve(stream: Stream, reqs, take: int | None = None) -> list:
    async def go():
        out = []
        async with contextlib.aclosing(stream.serve(_requests(reqs))) as responses:
            async for resp in responses:
                out.append(resp)
                if take is not None and len(out) == take:
                    break  # the client goes away mid-stream
        return out

    return asyncio.run(go())


def test_a_stream_opens_then_steps_and_releases_its_session_once():
    s = Stream()
    assert _serve(s, [Req("open", 1), Req("step", 2), Req("step", 3)]) == [
        "opened 1",
        "step 2 on entry-1",
        "step 3 on entry-1",
    ]
    assert s.log == ["responded"] * 3 + ["release entry-1"]


@pytest.mark.parametrize(
    "reqs, code, message",
    [
        ([Req("open", 1), Req("open", 2)], Status.FAILED_PRECONDITION, "open: this stream already has a session"),
        ([Req("step", 1)], Status.FAILED_PRECONDITION, "step: open the session first"),
        ([Req(None)], Status.INVALID_ARGUMENT, "request: set one of open, step"),
        ([Req("tree", 1)], Status.INVALID_ARGUMENT, "request: set one of open, step"),
    ],
)
def test_messages_out_of_order_or_of_no_kind_get_a_status_that_says_so(reqs, code, message):
    s = Stream()
    with pytest.raises(Abort) as e:
        _serve(s, reqs)
    assert (e.value.code, e.value.message) == (code, message)
    assert s.log.count("release entry-1") == (1 if reqs[0].kind == "open" else 0)


def test_the_session_is_released_when_a_handler_fails_or_the_client_leaves():
    s = Stream(fail_step=True)
    with pytest.raises(RuntimeError):
        _serve(s, [Req("open", 1), Req("step", 2)])
    assert s.log == ["responded", "release entry-1"]
    s = Stream()
    assert _serve(s, [Req("open", 1), Req("step", 2), Req("step", 3)], take=2) == ["opened 1", "step 2 on entry-1"]
    assert s.log[-1] == "release entry-1" and s.log.count("release entry-1") == 1


def test_an_open_that_fails_after_the_core_handed_over_a_session_still_releases_it():
    s = Stream(fail_open_after_claim=True)
    with pytest.raises(Abort) as e:
        _serve(s, [Req("open", 1)])
    assert e.value.code == Status.DEADLINE_EXCEEDED
    assert s.log == ["release entry-1"]


def test_a_draining_service_refuses_the_next_message_after_its_hook():
    s = Stream()

    async def reqs():
        yield Req("open", 1)
        s.is_draining = True  # SIGTERM between two messages
        yield Req("step", 2)

    async def go():
        out = []
        async with contextlib.aclosing(s.serve(reqs())) as responses:
            async for resp in responses:
                out.append(resp)
        return out

    with pytest.raises(Abort) as e:
        asyncio.run(go())
    assert e.value.code == Status.UNAVAILABLE and e.value.message.startswith(DRAINING)
    assert "drafter" in e.value.message
    assert s.log == ["responded", "flush", "release entry-1"]
