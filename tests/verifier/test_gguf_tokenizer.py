"""What a gateway reads of a GGUF file: its tokenizer, config and generation config alone
(``verifier.model.tokenizer_dir``), never its weights dequantized; the same tokenizer, end-of-turn
ids, vocabulary and chat template as the full conversion the verifier serves from."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoTokenizer

from tests.support.gguf_models import write
from verifier.model import eos_token_ids, resolve_model_dir, tokenizer_dir

pytestmark = pytest.mark.slow  # each file's vocabulary is parsed twice


def test_a_gguf_tokenizer_is_read_without_converting_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path / "base.gguf", "llama", "Q8_0", False, False)  # a base model: no template

    alone = tokenizer_dir(str(path))
    assert (alone / ".complete").exists() and alone.name.endswith("-tokenizer")
    assert not list(alone.glob("*.safetensors")), "the tokenizer's directory holds no weights"
    assert not (tmp_path / "cache" / "models" / alone.name.replace("-tokenizer", "-fp32")).exists()

    full = resolve_model_dir(str(path))  # the verifier's conversion
    assert tokenizer_dir(str(path)) == full  # once converted, the conversion serves the gateway too

    tok_alone, tok_full = AutoTokenizer.from_pretrained(alone), AutoTokenizer.from_pretrained(full)
    text = "Hello, world! Speculative decoding, 123 times."
    assert tok_alone.encode(text) == tok_full.encode(text)
    assert tok_alone.chat_template is None and tok_full.chat_template is None
    assert eos_token_ids(alone, tok_alone) == eos_token_ids(full, tok_full) != ()
    assert AutoConfig.from_pretrained(alone).vocab_size == AutoConfig.from_pretrained(full).vocab_size


def test_a_gguf_tokenizer_keeps_the_files_chat_template(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path / "chat.gguf", "llama", "Q8_0", True, False)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(str(path)))
    assert tok.chat_template
    messages = [{"role": "user", "content": "hi there"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "hi there" in text and text != "hi there"


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_a_byte_level_vocabulary_loads_back_as_the_file_splits_it(tmp_path, monkeypatch, family):
    """A file whose vocabulary is byte-level BPE (``tokenizer.ggml.model`` gpt2) under an architecture
    whose own tokenizer class is SentencePiece's (Gemma 3): the saved tokenizer loads back with the
    file's splitting (transformers' class for the architecture rebuilt its own, every space an
    unknown token), for the gateway's directory and the verifier's conversion alike."""
    monkeypatch.setenv("RACER_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path / f"{family}.gguf", family, "Q8_0", True, False)
    direct = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "Hello world, this is a test: 12 tokens!"
    want = direct.encode(text)
    assert direct.decode(want) == text
    for where in (tokenizer_dir(str(path)), resolve_model_dir(str(path))):
        tok = AutoTokenizer.from_pretrained(where)
        assert tok.encode(text) == want, where
        assert tok.chat_template == direct.chat_template
        assert (tok.bos_token, tok.eos_token) == (direct.bos_token, direct.eos_token)


def test_the_conversions_of_a_file_replaced_or_removed_are_pruned_when_another_is_made(tmp_path, monkeypatch):
    """The cache is keyed by the GGUF file's path, size and mtime: a file replaced in place, or a
    virtual environment's copy removed, must not leave its float32 copy behind for good."""
    monkeypatch.setenv("RACER_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write(tmp_path / "a" / "m.gguf", "llama", "Q8_0", False, False)
    old_full, old_tok = resolve_model_dir(str(first)), tokenizer_dir(str(write(tmp_path / "t.gguf", "llama")))
    assert old_full.exists() and old_tok.exists()
    unrecorded = models / "made-before-sources-were-recorded-fp32"  # no record: left alone
    unrecorded.mkdir()
    (unrecorded / ".complete").touch()

    write(first, "llama", "Q8_0", False, False, seed=1)  # replaced in place: another size or mtime
    (tmp_path / "t.gguf").unlink()  # removed
    kept = write(tmp_path / "b" / "m.gguf", "llama", "Q8_0", False, False)
    new_full = resolve_model_dir(str(kept))  # the next conversion prunes

    assert new_full.exists() and unrecorded.exists()
    assert not old_full.exists(), "the replaced file's conversion was kept"
    assert not old_tok.exists(), "the removed file's tokenizer directory was kept"
    again = resolve_model_dir(str(first))  # the replaced file converts again, under its new key
    assert again != old_full and again.exists() and new_full.exists()
    assert sorted(p.name for p in models.iterdir()) == sorted([again.name, new_full.name, unrecorded.name])
