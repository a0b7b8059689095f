"""A GGUF file's projection weights kept as the file stores them: block-quantized, read in place.

``--dtype gguf`` loads the model as float32 (norms, embedding, and every weight a kernel here does
not take: the file's values, dequantized) and hands each projection of a model the llama backend
serves (Llama, Mistral, Qwen2/3, SmolLM3, Gemma 1/2/3, Phi-3) and the output layer the
file's own blocks (``Blocks``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, where the native
block kernel is built (``native_quant.c``). The native decoder and the output layer then read those blocks; a
weight stored in any other format is served from its dequantized float32 values, and a log line
names it. The residual stream and activations stay float32; the KV cache is float16 (``cache_dtype``).

The arithmetic is llama.cpp's (8-bit activations per 32 values, integer dot products) with every
float32 step in a fixed order, so a row's result never depends on the rows it shares a call with or
on the thread count: racer's output equals ``off``'s bit for bit, as in reduced precision.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import arena, native

log = logging.getLogger(__name__)

# GGML type numbers the block kernel takes.
KINDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}

_NAMES = {
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}
# Phi-3's fused weights, one tensor each in the file as in the model: q, k and v rows in ``attn_qkv``,
# gate then up rows in ``ffn_up`` (llama.cpp's converter writes them as the model holds them, and
# transformers reads them so); the forward splits their outputs as the modules do.
_FUSED = {"attn_qkv": ("self_attn", "qkv_proj"), "ffn_up": ("mlp", "gate_up_proj")}


def _layer_modules(layer) -> dict[str, torch.nn.Module]:
    """A decoder layer's projection modules by their tensors' short names in a GGUF file."""
    found: dict[str, torch.nn.Module] = {}
    for short, (part, proj) in (*_NAMES.items(), *_FUSED.items()):
        module = getattr(getattr(layer, part), proj, None)
        if module is not None:
            found.setdefault(short, module)
    return found


@dataclass
class Blocks:
    """One weight [n, k] as a GGUF file stores it: ``data`` uint8, rows in the module's order, either
    as stored ([n, row bytes]; ``kind`` its GGML type number) or packed in groups of 8 rows
    ([n / 8, 8 x row bytes]; ``kind`` the GGML number + ``native.PACKED``); ``name`` its type's name."""

    data: torch.Tensor
    kind: int
    name: str
    n: int
    k: int

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, k] -> x @ W.T (+ bias) [M, n] float32 by the block kernel."""
        return native.quant_linear(x, self.kind, self.data, self.n, self.k, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The file's values of rows ``ids``, float32 [len(ids), k]."""
        return native.quant_rows(self.kind, self.data, ids, self.k)

    def row_range(self, a: int, b: int) -> "Blocks | None":
        """Rows [a, b) as a weight of their own, sharing the bytes (a fused weight's parts: Phi-3's
        q, k and v in one); None where a packed group would be cut."""
        if self.kind > native.PACKED:
            return None if a % 8 or b % 8 else Blocks(self.data[a // 8 : b // 8], self.kind, self.name, b - a, self.k)
        return Blocks(self.data[a:b], self.kind, self.name, b - a, self.k)


# The architectures (``general.architecture``) whose q and k rows llama.cpp's converter permutes:
# Llama's, which Mistral models are written as too. Every other family's rows are stored in the
# model's order, and transformers' GGUF loader reverses the permutation for these only
# (``modeling_gguf_pytorch_utils.TENSOR_PROCESSORS``).
PERMUTED = ("llama", "mistral")


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """A q or k weight's rows put back in the model's order: llama.cpp's converter interleaves each
    head's two rotary halves (its ``permute``, for the architectures of ``PERMUTED``); rows are whole
    blocks, so the blocks move as they are."""
    n = rows.shape[0]
    order = np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(-1)
    out = np.empty_like(rows)
    out[order] = rows
    return out


_lock = threading.Lock()


def cache_dtype(model) -> torch.dtype:
    """The KV cache's dtype for ``model``: float16 where it serves a GGUF file's blocks, as llama.cpp
    keeps its cache by default (a long context's attention reads half the bytes: one thread, 800
    keys, a step 12% faster; both ``off`` and racer read the same cache, so they still agree bit for
    bit); else the model's own dtype."""
    if getattr(model, "_racer_gguf_file", None) is not None or getattr(model, "_racer_gguf", None) is not None:
        return torch.float16
    return model.lm_head.weight.dtype


def kept(model) -> dict | None:
    """What ``attach`` kept of the model's file (None for a model loaded otherwise). A model that
    ``model.load`` marked with its file (``--dtype gguf``) is given its blocks on the first call."""
    held = getattr(model, "_racer_gguf", None)
    path = getattr(model, "_racer_gguf_file", None)
    if held is not None or path is None:
        return held
    with _lock:
        if getattr(model, "_racer_gguf", None) is None:
            attach(model, Path(path))
    return model._racer_gguf


def projection_formats(path: Path) -> set[str]:
    """The formats of a GGUF file's layer projections (its ``blk.N.attn_*`` and ``ffn_*`` weights)."""
    from .gguf_file import tensors as read_tensors

    wanted = {f"{short}.weight" for short in (*_NAMES, *_FUSED)}
    return {t.kind for name, t in read_tensors(path).items() if name.split(".", 2)[-1] in wanted}


def takes(path: Path) -> bool:
    """Whether the block kernel built here takes every layer projection of the file at ``path`` as
    its blocks (``--dtype auto`` serves such a file from them)."""
    formats = projection_formats(path)
    return bool(formats) and all(f in KINDS and native.quant_supported(KINDS[f]) for f in formats)


def attach(model, path: Path) -> dict[str, int]:
    """Gives each projection of a ``model`` of a family the llama backend serves (loaded from
    ``path``, dequantized: Llama, Mistral, Qwen2/3, SmolLM3, Gemma 1/2/3, Phi-3: its fused
    ``attn_qkv`` and ``ffn_up`` as one weight each) and its output layer (the embedding where the
    file has no ``output.weight``: tied) the file's own blocks where the block
    kernel takes their format; q and k rows are put back in the model's order for the architectures
    of ``PERMUTED`` only. Biases (Qwen2's q/k/v) stay float32 on their modules, added by the kernel.
    Returns how many weights of each format were kept as blocks; the others are logged and stay
    float32."""
    from .gguf_file import metadata
    from .gguf_file import tensors as read_tensors

    tensors = read_tensors(path)
    permuted = metadata(path, ("general.architecture",)).get("general.architecture") in PERMUTED
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    wanted: list[tuple[str, torch.nn.Module, int]] = []
    for i, layer in enumerate(model.model.layers):
        for short, module in _layer_modules(layer).items():
            rope_heads = (heads if short == "attn_q" else kv_heads if short == "attn_k" else 0) if permuted else 0
            wanted.append((f"blk.{i}.{short}.weight", module, rope_heads))
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    wanted.append((head, model.lm_head, 0))
    counts: dict[str, int] = {}
    others: dict[str, int] = {}
    for name, module, rope_heads in wanted:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path.name} has no tensor {name}")
        kind = t.kind
        n, k = module.weight.shape
        if kind not in KINDS or not native.quant_supported(KINDS[kind]) or k % (256 if "K" in kind else 32):
            others[kind] = others.get(kind, 0) + 1
            continue
        rows = np.asarray(t.data).reshape(n, -1)
        if rope_heads:
            rows = unpermute(rows, rope_heads)
        data, number = torch.from_numpy(np.array(rows, order="C")), KINDS[kind]
        packed = native.quant_pack(number, data, n, k) if arena.enabled() else None
        if packed is not None:  # 8 rows a group: the same bytes, read a vector of 8 rows at a time
            number, data = packed
        module.racer_blocks = Blocks(data, number, kind, n, k)
        counts[kind] = counts.get(kind, 0) + 1
    for kind, count in sorted(others.items()):
        why = "no native block kernel here" if native.library() is None else "a format the block kernel does not take"
        log.warning("%s: %d %s weights served dequantized to float32 (%s)", path.name, count, kind, why)
    model._racer_gguf = {"path": str(path), "blocks": counts, "dequantized": others}
    log.info("%s: weights kept as stored: %s", path.name, counts)
    return counts
