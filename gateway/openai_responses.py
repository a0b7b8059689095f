"""The gateway's ``Chunk`` and ``Finished`` as OpenAI answers: the whole response, the streamed events
(text, tool-call and usage chunks), log-probabilities as OpenAI returns them, and the model list.

Beyond OpenAI's fields, answers carry ``session_id`` (a kept session's, to continue it) and
``speculation`` (the turn's rounds, drafted and accepted tokens, MAT, timings).
"""

from __future__ import annotations

from . import tools as T
from .links import LogProbs
from .openai_requests import Call
from .stops import StopText
from .turn import Finished


def _stats(f: Finished) -> dict:
    s = f.stats
    return {
        "rounds": s.rounds,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "mat": round(s.mat, 4),
        "prefill_ms": round(f.prefill_ms, 3),
        "draft_ms": round(f.draft_ms, 3),
        "verify_ms": round(f.verify_ms, 3),
        "total_ms": round(f.total_ms, 3),
        "tokens_per_second": round(f.tokens_per_second, 3),
        "session_tokens": f.session_tokens,
    }


def usage(f: Finished) -> dict:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    }


def finish_reason(f: Finished, text: StopText) -> str:
    return "stop" if text.hit else f.finish_reason


def _head(call: Call, obj: str, session_id: str) -> dict:
    out = {"id": f"{'chatcmpl' if call.chat else 'cmpl'}-{call.id}", "object": obj, "created": call.created}
    out["model"] = call.model
    if call.keep_session:  # a one-call session is gone when the answer arrives: no id to continue
        out["session_id"] = session_id
    return out


def response(
    call: Call, f: Finished, text: str, reason: str, token_ids: list[int], logprobs: dict | None = None
) -> dict:
    """The whole answer of a call without ``stream`` (``logprobs``: the choice's, made by ``Tokens``)."""
    if call.chat:
        message: dict = {"role": "assistant", "content": text}
        parsed = T.parse(call.tool_parser, text) if call.tool_parser else None
        if parsed is not None and parsed[1]:
            content, calls = parsed
            calls = calls if call.parallel_tool_calls else calls[:1]
            message = {"role": "assistant", "content": content or None, "tool_calls": [c.openai() for c in calls]}
            if reason == "stop":
                reason = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": logprobs}
        out = _head(call, "chat.completion", f.session_id)
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs}
        out = _head(call, "text_completion", f.session_id)
    choice["finish_reason"] = reason
    if call.return_token_ids:
        choice["token_ids"] = token_ids
    out.update(choices=[choice], usage=usage(f), speculation=_stats(f))
    return out


def chunk(
    call: Call,
    session_id: str,
    text: str | None,
    token_ids: list[int],
    reason: str | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One streamed event: a text delta (chat: ``text`` None is the opening delta with the role)."""
    if call.chat:
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        out = _head(call, "chat.completion.chunk", session_id)
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        out = _head(call, "text_completion", session_id)
    if call.return_token_ids and text is not None:
        choice["token_ids"] = token_ids
    out["choices"] = [choice]
    return out


def tool_call_chunks(call: Call, session_id: str, index: int, tc: T.ToolCall, piece: int = 32) -> list[dict]:
    """A call as streamed deltas: the first with its index, id, type and name (arguments ""), then
    its arguments in fragments of ``piece`` characters."""
    first = {"index": index, "id": T.new_call_id(), "type": "function", "function": {"name": tc.name, "arguments": ""}}
    deltas = [first] + [
        {"index": index, "function": {"arguments": tc.arguments[i : i + piece]}}
        for i in range(0, len(tc.arguments), piece)
    ]
    out = []
    for d in deltas:
        ev = _head(call, "chat.completion.chunk", session_id)
        ev["choices"] = [{"index": 0, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}]
        out.append(ev)
    return out


class Tokens:
    """Log-probabilities as OpenAI returns them, from the verifier's (chat: ``content`` entries;
    completions: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

    def __init__(self, call: Call, tokenizer):
        self.call = call
        self.tokenizer = tokenizer
        self.offset = 0  # completions: characters before the next token

    def _text(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer is not None else ""

    def echo(self, ids: list[int], lp: LogProbs | None) -> tuple[str, dict | None]:
        """The echoed prompt: its text, and its tokens' entries (the first one's log-probability is None)."""
        r = self.call.request
        text = r.prompt if r.input == "text" else (self.tokenizer.decode(ids) if self.tokenizer is not None else "")
        return text, self.entries(ids, lp)

    def entries(self, ids: list[int], lp: LogProbs | None) -> dict | None:
        if lp is None or self.call.logprobs < 0:
            return None
        if self.call.chat:
            content = []
            for t, v, top_ids, top in zip(ids, lp.chosen, lp.top_ids, lp.top):
                text = self._text(t)
                content.append(
                    {
                        "token": text,
                        "logprob": v,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {"token": (s := self._text(i)), "logprob": w, "bytes": list(s.encode())}
                            for i, w in zip(top_ids, top)
                        ],
                    }
                )
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, v, top_ids, top in zip(ids, lp.chosen, lp.top_ids, lp.top):
            text = self._text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(v)
            out["top_logprobs"].append(None if v is None else {self._text(i): w for i, w in zip(top_ids, top)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    @staticmethod
    def join(parts: list[dict]) -> dict | None:
        if not parts:
            return None
        out = {k: [] for k in parts[0]}
        for p in parts:
            for k, v in p.items():
                out[k].extend(v)
        return out


def last_chunk(call: Call, f: Finished, reason: str) -> dict:
    """The event with the finish reason, the speculation stats (and usage when asked for)."""
    out = chunk(call, f.session_id, "", [], reason)
    out["speculation"] = _stats(f)
    out["usage"] = None
    return out


def usage_chunk(call: Call, f: Finished) -> dict:
    """``stream_options.include_usage``: after the last choice, an event with no choices and the usage."""
    out = _head(call, "chat.completion.chunk" if call.chat else "text_completion", f.session_id)
    out.update(choices=[], usage=usage(f))
    return out


def models(name: str, created: int) -> dict:
    return {"object": "list", "data": [model(name, created)]}


def model(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "racer"}
