"""A Generate request checked at the door: every field against its limit, then the input tokenized.

A request that passes cannot make a drafter or verifier refuse a message of its turn, so a refusal
there is the gateway's bug (INTERNAL), not the caller's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.errors import Abort, FieldError, Status, invalid
from common.params import MODES, SamplingParams
from common.text import continue_ids, messages_ids, text_ids

DEFAULT_MAX_NEW_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_IDS = 64
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Limits:
    max_prompt_tokens: int = 8192  # tokens of a session's history before a turn generates
    max_new_tokens: int = 2048
    max_budget: int = 256
    max_sessions_per_tenant: int = 32  # turns running at once per tenant, on one gateway (0: no limit)


def request_bytes(limits: Limits) -> int:
    """The largest Generate request that can pass the checks: text of up to 64 characters per
    allowed token at 4 UTF-8 bytes each (``prompt_ids`` need at most 5 bytes per token), plus room
    for the other fields. The gateway's gRPC message limit (a larger message is refused before it is
    read into memory)."""
    return 4 * 64 * limits.max_prompt_tokens + 256 * 1024


@dataclass(frozen=True)
class Request:
    """A Generate request's fields as the client sent them (the servicer copies them out of protobuf)."""

    session_id: str = ""  # "": a new session
    input: str | None = None  # which one is set: "prompt", "chat", "prompt_ids" or "text" (no chat template)
    prompt: str = ""
    system: str = ""
    chat: tuple[tuple[str, str], ...] = ()  # (role, content)
    prompt_ids: tuple[int, ...] = ()
    max_new_tokens: int = 0  # 0: the default
    mode: str = ""  # "": racer
    budget: int = 0  # 0: adaptive
    temperature: float = 0.0
    top_p: float = 0.0  # 0: off (1.0)
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    share: bool = True  # False: this turn is not added to the tenant corpus
    keep: bool = True  # False: a one-call session, closed after this turn (never counted as a kept session)
    # chat: per message, JSON of its keys beyond role and content ("" none): tool_calls, tool_call_id
    chat_extra: tuple[str, ...] = ()
    tools: str = ""  # JSON array of tool definitions for the chat template ("" none)
    grammar: object = None  # gateway.grammar.GrammarSpec: what the output is constrained to (None: free)
    logprobs: int = -1  # log-probabilities of each new token: -1 none, 0 its own, n: and the top n
    forced: bool = True  # with a grammar: the tokens it forces are drafted as a path of their own
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    echo: bool = False  # the turn's first chunk carries the input tokens' log-probabilities
    # a kept session's next turn only if the session holds exactly this many tokens (-1: whatever it
    # holds); ABORTED otherwise (another turn continued it since the caller looked)
    expect_tokens: int = -1


@dataclass(frozen=True)
class TurnRequest:
    """What a turn runs with, once checked."""

    session_id: str
    max_new: int
    mode: str
    budget: int  # tree nodes per round; 0: adaptive
    sampling: SamplingParams
    stop: tuple[str, ...]  # stop strings
    stop_ids: tuple[int, ...]  # the request's own; the turn adds the model's end-of-sequence ids
    share: bool = True  # this turn's response goes into the tenant corpus (if the tenant shares)
    grammar: object = None  # gateway.grammar.GrammarSpec, or None
    logprobs: int = -1
    forced: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    echo: bool = False


def check(r: Request, limits: Limits, vocab_size: int | None) -> TurnRequest:
    """Every field but the input (which needs the session's history) against its limit."""
    lim = limits
    max_new = r.max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, lim.max_new_tokens)  # 0: the default, within the limit
    if not 1 <= max_new <= lim.max_new_tokens:
        raise invalid("max_new_tokens", f"{r.max_new_tokens}, expected 1..{lim.max_new_tokens}")
    mode = r.mode or "racer"
    if mode not in MODES:
        raise invalid("speculation.mode", f"{mode!r}, expected one of {', '.join(MODES)}")
    if not 0 <= r.budget <= lim.max_budget:
        raise invalid("speculation.budget", f"{r.budget}, expected 0 (adaptive) or 1..{lim.max_budget}")
    try:
        sampling = SamplingParams(r.temperature, r.top_p or 1.0, r.top_k, r.seed)
    except FieldError as e:
        raise Abort(Status.INVALID_ARGUMENT, str(e), field=e.field) from None
    if len(r.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in r.stop):
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
    if any(s == "" for s in r.stop):
        raise invalid("stop", "empty stop string")
    if len(r.stop_ids) > MAX_STOP_IDS:
        raise invalid("stop_ids", f"{len(r.stop_ids)} ids, at most {MAX_STOP_IDS}")
    if any(t < 0 or (vocab_size and t >= vocab_size) for t in r.stop_ids):
        raise invalid("stop_ids", "token id outside the vocabulary")
    if any(t < 0 or (vocab_size and t >= vocab_size) for t, _ in r.logit_bias):
        raise invalid("logit_bias", f"a token id outside the vocabulary [0, {vocab_size})")
    if r.system and r.input != "prompt":
        raise invalid("system", "only with a prompt input (chat carries its own)")
    return TurnRequest(
        r.session_id,
        max_new,
        mode,
        r.budget,
        sampling,
        r.stop,
        r.stop_ids,
        r.share,
        r.grammar,
        r.logprobs,
        r.forced,
        r.logit_bias,
        r.presence_penalty,
        r.frequency_penalty,
        r.echo,
    )


def input_ids(
    r: Request, history: list[int], tokenizer, eos_ids, limits: Limits, vocab_size: int | None, template=None
) -> list[int]:
    """The turn's new tokens: ``prompt_ids`` as they are, text through the chat template after ``history``
    (``template``: the template text to use, None: the tokenizer's own)."""
    ids = _input_ids(r, history, tokenizer, eos_ids, limits, vocab_size, template)
    if len(ids) > limits.max_prompt_tokens:
        raise invalid(r.input, f"{len(ids)} tokens, the limit is max_prompt_tokens={limits.max_prompt_tokens}")
    return ids


def _input_ids(r: Request, history, tokenizer, eos_ids, limits: Limits, vocab_size: int | None, template) -> list[int]:
    kind = r.input
    if kind is None:
        raise invalid("input", "set one of prompt, chat, prompt_ids, text")
    if kind == "prompt_ids":
        ids = list(r.prompt_ids)
        if not ids:
            raise invalid("prompt_ids", "empty")
        bad = next((t for t in ids if t < 0 or (vocab_size and t >= vocab_size)), None)
        if bad is not None:
            raise invalid("prompt_ids", f"token id {bad} outside the vocabulary [0, {vocab_size})")
        return ids
    if tokenizer is None:
        raise Abort(Status.FAILED_PRECONDITION, f"{kind}: this gateway has no tokenizer; send prompt_ids", field=kind)
    if kind in ("prompt", "text"):
        if not r.prompt:
            raise invalid("prompt", "empty")
    if kind == "prompt":
        messages = [{"role": "user", "content": r.prompt}]
        if r.system and not history:
            messages.insert(0, {"role": "system", "content": r.system})
    elif kind == "chat":
        messages = [{"role": role, "content": content} for role, content in r.chat]
        for m, extra in zip(messages, r.chat_extra):
            if extra:
                m.update(json.loads(extra))
        if not messages:
            raise invalid("chat.messages", "empty")
        bad = next((m["role"] for m in messages if m["role"] not in ROLES), None)
        if bad is not None:
            raise invalid("chat.messages.role", f"{bad!r}, expected system, user or assistant")
    elif kind != "text":
        raise invalid("input", f"{kind!r}, expected prompt, chat, prompt_ids or text")
    # Text longer than this cannot fit the token limit (a token is at least one character for the
    # tokenizers this serves; checked before tokenizing a huge string).
    chars = len(r.prompt) + len(r.system) + sum(len(content) for _, content in r.chat)
    chars += len(r.tools) + sum(len(extra) for extra in r.chat_extra)
    if chars > 64 * limits.max_prompt_tokens:
        raise invalid(
            kind,
            f"{chars} characters, more than max_prompt_tokens={limits.max_prompt_tokens} tokens "
            "can hold (refused before tokenizing)",
        )
    if kind == "text":  # plain continuation (a completions call): special tokens only at a session's start
        ids = text_ids(tokenizer, r.prompt, special=not history)
        if not ids:
            raise invalid("prompt", "no tokens")
        return ids
    kw = {}
    if r.tools:
        kw["tools"] = json.loads(r.tools)
    if template is not None:
        kw["chat_template"] = template
    try:
        if history:
            return continue_ids(tokenizer, history, messages, eos_ids, **kw)
        return messages_ids(tokenizer, messages, **kw)
    except Exception as e:  # noqa: BLE001 - template errors are the caller's input
        raise invalid(kind, f"the chat template rejected it: {e}") from None
