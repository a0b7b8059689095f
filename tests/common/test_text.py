"""Incremental detokenization gives the text of the whole id list, whatever the chunking."""

from __future__ import annotations

import random

import pytest

from common.text import Detokenizer

pytestmark = pytest.mark.slow


def test_incremental_text_equals_decoding_everything(default_model):
    tok = default_model.tokenizer
    samples = [
        "Héllo wörld — naïve café: 東京 🚀🚀 ok.\n\n  indented  code()\t# done",
        "def f(x):\n    return x ** 2  # ½ ≈ 0.5",
        "<|im_start|>assistant\nSure! Here's 1, 2, 3…<|im_end|>",
    ]
    rng = random.Random(0)
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for _ in range(5):
            d, out, i = Detokenizer(tok), [], 0
            while i < len(ids):
                n = rng.randint(1, 3)
                out.append(d.push(ids[i : i + n]))
                i += n
            assert "".join(out) == tok.decode(ids, skip_special_tokens=True) == d.text
