"""Text <-> token ids for chat sessions: first turns, later turns, incremental detokenization.

No torch here: the gateway only needs a tokenizer.
"""

from __future__ import annotations

DEFAULT_SYSTEM = "You are a helpful assistant."


def _ids(out) -> list[int]:
    if hasattr(out, "keys"):  # BatchEncoding in transformers 5
        out = out["input_ids"]
    return list(out)


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template of its own (a base model's has none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_ids(tokenizer, user: str, system: str | None = DEFAULT_SYSTEM) -> list[int]:
    """Token ids of a one-turn chat with the model's template and the assistant prompt opened."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return messages_ids(tokenizer, messages)


def prompt_ids(tokenizer, prompt: str, system: str | None = DEFAULT_SYSTEM) -> list[int]:
    """A one-turn chat (``chat_ids``) where the model has a chat template; else, for a base model,
    the prompt as plain text to continue (``system`` unused), as the stack serves such a model."""
    if has_chat_template(tokenizer):
        return chat_ids(tokenizer, prompt, system)
    return text_ids(tokenizer, prompt)


def messages_ids(tokenizer, messages: list[dict], **template) -> list[int]:
    """``template``: ``apply_chat_template``'s own keywords (``tools``, ``chat_template``)."""
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template))


def text_ids(tokenizer, text: str, special: bool = True) -> list[int]:
    """Token ids of plain text, no chat template (a completion prompt); ``special``: the tokenizer's
    own start tokens, if it adds any (not in the middle of a session)."""
    return _ids(tokenizer(text, add_special_tokens=special))


def continue_ids(tokenizer, history: list[int], messages: list[dict], eos_ids=(), **template) -> list[int]:
    """Ids that continue a chat session whose ``history`` ends with the assistant's last answer.

    The template decides what closes an assistant turn and opens the next ones; a probe
    conversation finds that text. If the answer ended with an end-of-turn token, the part of the
    closing text that token already wrote is not repeated.
    """
    probe = [{"role": "user", "content": "\x00u"}, {"role": "assistant", "content": "\x00a"}]
    base = tokenizer.apply_chat_template(probe, tokenize=False, **template)
    full = tokenizer.apply_chat_template(probe + list(messages), tokenize=False, add_generation_prompt=True, **template)
    if not full.startswith(base) or "\x00a" not in base:
        raise ValueError("this model's chat template cannot continue a conversation turn by turn")
    close = base[base.rindex("\x00a") + 2 :]  # e.g. "<|im_end|>\n"
    if history and history[-1] in eos_ids:
        eos_text = tokenizer.decode([history[-1]], skip_special_tokens=False)
        if close.startswith(eos_text):
            close = close[len(eos_text) :]
    return _ids(tokenizer(close + full[len(base) :], add_special_tokens=False))


class Detokenizer:
    """Incremental text from a growing id list, in constant time per token.

    Decodes only a short window: the ids since the last emitted text plus the few before them
    (their context: merges, a leading space). A window that ends inside a multi-byte character
    (decoding to U+FFFD) waits for the next token.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # ids up to here are in ``text``

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        now = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        delta = now[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
