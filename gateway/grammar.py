"""Constrained decoding: the tokens a grammar allows after every position a turn asks about.

The grammar lives here, in the gateway, which holds the tokenizer: for each draft tree it walks the
grammar along every node's own path (accepting the node's token, descending, rolling back) and sends
the verifier one mask per node; the verifier only removes the masked tokens before the target
chooses (``verifier/constraints.py``). A node whose token its parent's mask forbids can never be
accepted, so a draft outside the grammar is rejected, never emitted, and the output with drafts is
the output without them.

xgrammar was chosen by measurement on the serving CPU (``racer/bench/grammar.py``): its masks cost
the least per token and it rolls back, which tree walks need; its compiler caches compiled
grammars (and so does ``Grammars`` per request spec).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from common.errors import Abort, Status

TOOL_OPEN = "<tool_call>\n"
TOOL_CLOSE = "\n</tool_call>"


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. ``kind``: ``json_object`` (any JSON object),
    ``json_schema`` (``text``: the schema), ``tool_call`` (``text``: the schema of one call object,
    written between the hermes-style ``<tool_call>`` tags); ``field``: the request field it came from."""

    kind: str
    text: str = ""
    field: str = "response_format"


class Grammars:
    """Compiles grammars over one tokenizer's vocabulary; the last ``cache`` compiled ones are kept."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=(), cache: int = 256):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self.cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self.size = cache

    def compile(self, spec: GrammarSpec):
        """The compiled grammar; INVALID_ARGUMENT naming ``spec.field`` when the library refuses it."""
        got = self.cache.get(spec)
        if got is not None:
            self.cache.move_to_end(spec)
            return got
        xgr = self.xgr
        try:
            if spec.kind == "json_object":  # an object (OpenAI's json_object), whatever it holds
                compiled = self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            elif spec.kind == "json_schema":
                compiled = self.compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=True)
            elif spec.kind == "tool_call":
                call = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True)
                compiled = self.compiler.compile_grammar(
                    xgr.Grammar.concat(_literal(xgr, TOOL_OPEN), call, _literal(xgr, TOOL_CLOSE))
                )
            else:
                raise ValueError(f"unknown grammar kind {spec.kind!r}")
        except Exception as e:  # noqa: BLE001 - the library's refusal of the caller's schema
            raise Abort(
                Status.INVALID_ARGUMENT,
                f"{spec.field}: the schema is not supported: {_first_line(e)}",
                field=spec.field,
            ) from None
        self.cache[spec] = compiled
        if len(self.cache) > self.size:
            self.cache.popitem(last=False)
        return compiled

    def constraint(self, spec: GrammarSpec) -> Constraint:
        return Constraint(self.xgr, self.compile(spec), self.vocab_size, self._encode)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _literal(xgr, text: str):
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


class Constraint:
    """One turn's grammar state: after every token emitted so far (``advance``)."""

    def __init__(self, xgr, compiled, vocab_size: int, encode=None):
        self.encode = encode  # text -> token ids: the forced text as the model would likely spell it
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.words = (vocab_size + 31) // 32
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.emitted = 0

    def _fill(self) -> np.ndarray:
        if self.matcher.is_terminated():
            return np.zeros(self.words, np.int32)  # nothing after the end: the turn has stopped
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0].numpy().copy()

    def open_mask(self) -> bytes:
        """The tokens allowed after the committed tokens: before the last emitted one (the root, which
        a reopened verifier chooses again), or at the start."""
        if not self.emitted:
            return self._fill().tobytes()
        last = self._last
        self.matcher.rollback(1)
        mask = self._fill()
        self.matcher.accept_token(last)
        return mask.tobytes()

    def tree_masks(self, tokens: list[int], parents: list[int]) -> bytes:
        """Per node, the tokens allowed after its path; the root is the last emitted token."""
        n = len(tokens)
        out = np.zeros((n, self.words), np.int32)
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(i)
        stack: list[tuple[int, int]] = [(0, 0)]  # (node, next child to visit); its path is accepted
        out[0] = self._fill()
        m = self.matcher
        while stack:
            node, k = stack[-1]
            if k == len(children[node]):
                stack.pop()
                if stack:
                    m.rollback(1)
                continue
            stack[-1] = (node, k + 1)
            c = children[node]
            child = c[k]
            if allowed(out[node], tokens[child]) and m.accept_token(tokens[child]):
                out[child] = self._fill()
                stack.append((child, 0))
        return out.tobytes()

    def advance(self, tokens: list[int]) -> None:
        """``tokens`` were emitted (each one the verifier chose among the allowed ones)."""
        for t in tokens:
            if not self.matcher.accept_token(t):
                raise Abort(Status.INTERNAL, f"the verifier emitted token {t}, which the grammar does not allow")
            self._last = t
            self.emitted += 1

    def forced(self, limit: int) -> list[int]:
        """A draft of what the grammar forces after the emitted tokens (at most ``limit`` tokens): the
        text it leaves no choice about (JSON keys, quotes, braces, a tool's name), tokenized, and a
        token that is the only one allowed (the end of the output). The text has one spelling but
        several tokenizations may be allowed, so these are drafts for the verifier to check, like
        any other: the target still chooses every token."""
        out: list[int] = []
        m = self.matcher
        while len(out) < limit and not m.is_terminated():
            text = m.find_jump_forward_string() if self.encode is not None else ""
            took = 0
            for t in self.encode(text) if text else ():
                if len(out) == limit or not m.accept_token(t):
                    break
                out.append(t)
                took += 1
            if took:
                continue
            bits = np.unpackbits(self._fill().view(np.uint8), bitorder="little")
            ones = np.flatnonzero(bits)
            if len(ones) != 1 or not m.accept_token(int(ones[0])):
                break
            out.append(int(ones[0]))
        if out:
            m.rollback(len(out))
        return out


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)
