"""Tiny random models written as GGUF files, as llama.cpp's converter writes them (nothing is
downloaded): ``write(path, family)``.

The model is ``racer.bench.tiny.make(family)`` (2 layers, hidden size 64) over the first 8,192
tokens of the bundled model's vocabulary; the file holds its weights under llama.cpp's tensor names (gguf's own
name map), the projections, the embedding and the output layer quantized in the format asked for
(gguf's quantizer), norms and biases in F32; the architecture's metadata under llama.cpp's keys;
and the bundled model's tokenizer (``tokenizer.ggml.*``) cut to those tokens, with a chat template or without one.
As llama.cpp does, the q and k rows of a Llama (and of a Mistral, written as a Llama) are permuted
and a Gemma's norm weights are stored plus one.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import quants

# family (racer.bench.tiny.FAMILIES) -> (general.architecture, general.name, config overrides)
ARCHS = {
    "llama": ("llama", "tiny llama", {}),
    # llama.cpp writes a Mistral as a Llama (architecture llama, its name in general.name), and
    # transformers reads it as one: the same computation, full attention
    "mistral": ("llama", "Mistral Tiny Instruct", {}),
    "qwen2": ("qwen2", "tiny qwen2", {}),
    # transformers reads no head size from a qwen3 file: the config class's default (128) it is
    "qwen3": ("qwen3", "tiny qwen3", {"head_dim": 128}),
    # llama.cpp writes no output layer for a Gemma 2 (its embedding is the output layer): tied=True
    "gemma2": ("gemma2", "tiny gemma2", {}),
    "gemma3_text": ("gemma3", "tiny gemma3", {}),
    # q, k, v in one ``attn_qkv``, gate and up in one ``ffn_up``, as the model holds them
    "phi3": ("phi3", "tiny phi3", {}),
    # LayerNorms and an ungated MLP: a family the llama backend does not serve
    "starcoder2": ("starcoder2", "tiny starcoder2", {}),
}
# The bundled tokenizer's first 8,192 tokens and the merges that make them: its merges are ordered as
# its ids (each merge's parts come before its result), so the first N tokens are a byte-level BPE of
# their own, which tokenizes any text. Parsing, converting and writing the whole 49k-token vocabulary
# took most of a test file's time.
VOCAB = 8192
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_QUANTIZED = (*_PROJECTIONS, "token_embd", "output")


@functools.lru_cache(maxsize=1)
def bundled_tokenizer() -> dict:
    """The bundled model's ``tokenizer.ggml.*`` fields and its chat template, read once."""
    from verifier.model import default_gguf_path

    fields = gguf.GGUFReader(default_gguf_path()).fields
    return {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}


def write(
    path: str | Path,
    family: str = "llama",
    fmt: str = "Q8_0",
    template: bool | str = True,
    tied: bool = False,
    seed: int = 0,
):
    """Writes ``family``'s tiny random model to the GGUF file ``path``: layer projections, embedding
    and output layer in ``fmt`` (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1); ``template``: the bundled chat
    template (True), this one (a string) or none (False); ``tied``: no ``output.weight`` (the
    embedding is the output layer). Returns the path."""
    from racer.bench.tiny import make

    arch, name, overrides = ARCHS[family]
    model = make(family, seed=seed, vocab_size=VOCAB, tie_word_embeddings=tied, **overrides)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # biases (Qwen2's q/k/v) random, not zero: a missed one shows
        for p_name, p in model.named_parameters():
            if p_name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, cfg, name, template)
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    names = gguf.get_tensor_name_map(_arch(arch), cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        file_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if file_name is None:
            raise ValueError(f"{family}: no GGUF name for {hf_name}")
        values = t.float().numpy().copy()
        short = file_name.split(".")[-2] if file_name.startswith("blk.") else file_name.rsplit(".", 1)[0]
        if arch == "llama" and file_name.endswith(".weight") and short in ("attn_q", "attn_k"):
            values = _permute(values, heads if short == "attn_q" else kv_heads)
        if arch.startswith("gemma") and "norm" in short:
            values = values + 1.0
        if values.ndim == 2 and short in _QUANTIZED and values.shape[1] % 32 == 0:
            kind = getattr(gguf.GGMLQuantizationType, fmt)
            writer.add_tensor(file_name, quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(file_name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _arch(name: str) -> gguf.MODEL_ARCH:
    return {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[name]


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a q or k weight's rows (each head's two rotary halves interleaved)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _metadata(writer: gguf.GGUFWriter, cfg, name: str, template: bool | str) -> None:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(cfg, "num_key_value_heads", None) or heads)
    if hasattr(cfg, "rms_norm_eps"):
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    else:  # LayerNorms (StarCoder2)
        writer.add_layer_norm_eps(cfg.norm_epsilon)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    tok = bundled_tokenizer()
    tokens = tok["tokenizer.ggml.tokens"][: cfg.vocab_size]
    kept = set(tokens)
    writer.add_tokenizer_model(tok["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(tok["tokenizer.ggml.token_type"][: cfg.vocab_size])
    writer.add_token_merges([m for m in tok["tokenizer.ggml.merges"] if m.replace(" ", "", 1) in kept])
    writer.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(tok["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(tok["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(tok["tokenizer.ggml.add_bos_token"])
    writer.add_add_space_prefix(tok["tokenizer.ggml.add_space_prefix"])
    if template:
        writer.add_chat_template(template if isinstance(template, str) else tok["tokenizer.chat_template"])
