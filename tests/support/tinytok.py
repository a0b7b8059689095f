"""A character-level tokenizer with a ChatML template that fits the tiny Llama's 96-token vocabulary,
so text prompts and chat turns go through the gateway's real tokenization path in tests."""

from __future__ import annotations

import string

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = "\n " + string.ascii_letters + string.digits + ".,!?'\"-:;()/_"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = 5  # <|im_end|>


JSON = "{}[]<>="  # what JSON and tool-call tags need beyond CHARS (``extra``)


def make_char_tokenizer(vocab_size: int = 96, extra: str = "", chat: bool = True):
    """``chat`` False: no chat template (a base model's tokenizer)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + list(CHARS + extra))}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIAL)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>", pad_token="<pad>"
    )
    if chat:
        fast.chat_template = TEMPLATE
    return fast
