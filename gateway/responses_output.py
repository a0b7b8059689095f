"""A response's output as the Responses API gives it: items built from the turn's text as it streams
(``message`` items with one ``output_text`` part, ``function_call`` items), the stream events that
build them, in the order the ``openai`` client's ``responses.stream`` helper reads them, and the
``response`` object itself.

The whole answer (no ``stream``) runs the same ``Output`` and keeps only its items, so an answer
streamed and not has the same items. Text is read for calls as chat reads it
(``gateway.tools.StreamParser``); whitespace before an item is held and dropped unless text follows.
"""

from __future__ import annotations

import copy
import time

from . import tools as T
from .openai_responses import _stats
from .responses_bodies import ResponsesBody
from .responses_input import new_id
from .turn import Finished

PIECE = 32  # characters of a call's arguments per delta event


class Events:
    """Stream events in the order they are made, each with its ``sequence_number``."""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.n, **copy.deepcopy(fields)}
        self.n += 1
        return ev


class Output:
    """The output items, from the text as it comes (``push``), then ``finish``; each returns its events."""

    def __init__(self, parser: str, parallel: bool, ev: Events):
        self.parser = T.StreamParser(parser) if parser else None
        self.parallel = parallel
        self.ev = ev
        self.items: list[dict] = []
        self.msg: dict | None = None  # the message item being written
        self.held = ""  # whitespace before any open message
        self.calls = 0

    def push(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.parser is None:
            return self._text(text)
        return self._parsed(self.parser.push(text))

    def finish(self, incomplete: bool) -> list[dict]:
        """The last events: what the parser held, then the open message closed (``incomplete``: cut by
        ``max_output_tokens``). An output with no item gets a message, empty if the text was."""
        out = self._parsed(self.parser.flush()) if self.parser is not None else []
        if not self.items:
            out += self._text(self.held, force=True)
        if self.msg is not None:
            out += self._close("incomplete" if incomplete else "completed")
        return out

    def _parsed(self, parts) -> list[dict]:
        out: list[dict] = []
        for it in parts:
            out += self._call(it) if isinstance(it, T.ToolCall) else self._text(it)
        return out

    def _text(self, text: str, force: bool = False) -> list[dict]:
        out: list[dict] = []
        if self.msg is None:
            self.held += text
            if not (self.held.strip() or force):
                return []
            text, self.held = self.held, ""
            out += self._open()
        part = self.msg["content"][0]
        part["text"] += text
        if text:
            out.append(self.ev("response.output_text.delta", **self._at(), content_index=0, delta=text, logprobs=[]))
        return out

    def _at(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open(self) -> list[dict]:
        self.msg = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.items.append(self.msg)
        added = self.ev("response.output_item.added", output_index=len(self.items) - 1, item=self.msg)
        part = {"type": "output_text", "text": "", "annotations": []}
        self.msg["content"].append(part)
        return [added, self.ev("response.content_part.added", **self._at(), content_index=0, part=part)]

    def _close(self, status: str) -> list[dict]:
        msg, self.msg = self.msg, None
        msg["status"] = status
        at = {"item_id": msg["id"], "output_index": self.items.index(msg)}
        part = msg["content"][0]
        return [
            self.ev("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]),
            self.ev("response.content_part.done", **at, content_index=0, part=part),
            self.ev("response.output_item.done", output_index=at["output_index"], item=msg),
        ]

    def _call(self, call: T.ToolCall) -> list[dict]:
        if self.calls and not self.parallel:  # the first call only
            return []
        out = self._close("completed") if self.msg is not None else []
        self.held = ""
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": T.new_call_id(), "name": call.name}  # fmt: skip
        self.items.append(item)
        out.append(self.ev("response.output_item.added", output_index=len(self.items) - 1, item=item))
        args = call.arguments
        for i in range(0, len(args), PIECE):
            out.append(self.ev("response.function_call_arguments.delta", **self._at(), delta=args[i : i + PIECE]))
        item.update(arguments=args, status="completed")
        out.append(self.ev("response.function_call_arguments.done", **self._at(), arguments=args))
        out.append(self.ev("response.output_item.done", output_index=len(self.items) - 1, item=item))
        self.calls += 1
        return out

    def call_ids(self) -> list[str]:
        return [it["call_id"] for it in self.items if it["type"] == "function_call"]


def head(b: ResponsesBody, rid: str, instructions: str | None) -> dict:
    """The response object's fields that the request sets: what a ``response.created`` event carries."""
    choice = b.tool_choice or "auto"
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": instructions,
        "max_output_tokens": b.max_output_tokens,
        "metadata": dict(b.metadata or {}),
        "model": b.model,
        "output": [],
        "parallel_tool_calls": b.parallel_tool_calls is not False,
        "previous_response_id": b.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": b.store is not False,
        "temperature": b.temperature if b.temperature is not None else 0.0,  # absent: greedy, as chat's
        "text": {"format": b.format.echo()},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.echo() for t in b.tools or ()],
        "top_p": b.top_p if b.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": None,
    }


def usage(f: Finished, kept: bool) -> dict:
    """Input: the whole context the turn read (the session's tokens before its output), of which
    ``cached_tokens`` came from the kept session's cache or the verifier's prefix cache, and
    ``cache_write_tokens`` were prefilled into a session that is kept for the next response."""
    inp = f.session_tokens - f.completion_tokens
    cached = min(f.cached_tokens, inp)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": inp - cached if kept else 0},
        "output_tokens": f.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + f.completion_tokens,
    }


def finished(obj: dict, out: Output, f: Finished, kept: bool, token_ids: list[int] | None) -> dict:
    """The response object once its turn ended: its output, status, usage and speculation."""
    cut = f.finish_reason == "length"
    done = dict(obj, output=out.items, status="incomplete" if cut else "completed", usage=usage(f, kept))
    if cut:
        done["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        done["completed_at"] = int(time.time())
    done["speculation"] = _stats(f)
    if token_ids is not None:
        done["token_ids"] = token_ids
    return done


def failed(obj: dict, out: Output, code: str, message: str) -> dict:
    return dict(obj, output=out.items, status="failed", error={"code": code, "message": message})
