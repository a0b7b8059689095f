"""Forward passes over a session's KV cache: a lean path for Llama-family models and a generic one.

Both backends answer the same question: given ``n`` new tokens, their positions and which cached or
new tokens each may attend to, return the final hidden states of the new tokens and keep their K/V
rows in the cache so that the accepted ones can be kept and the rest dropped.

* ``FastLlamaBackend`` runs the decoder layers of a Llama-family model (Llama, Mistral, Qwen2/3,
  SmolLM) directly on the model's own weights and modules, with a preallocated KV cache that is
  compacted in place. On a CPU this is what makes tree verification cheap: no cache concatenation
  per step, no generic mask construction, and the output projection done as ``W @ x.T``, which
  MKL runs 2-4x faster than ``x @ W.T`` for 2-16 rows of a 49k vocabulary (same bits).
* The generic backend (``verifier/generic.py``) runs any other decoder-only causal LM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# mask: [n, past_len + n] bool, True = may attend.


class FastLlamaBackend:
    """Decoder forward over a preallocated per-session KV cache [layers, 2, kv_heads, capacity, head_dim]."""

    def __init__(self, model, capacity: int = 1024):
        self.model = model
        inner = model.model
        cfg = model.config
        self.layers = list(inner.layers)
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head_w = model.lm_head.weight  # [V, hidden]
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.dtype = self.lm_head_w.dtype
        self.device = self.lm_head_w.device
        self.cache = torch.empty(
            (len(self.layers), 2, self.n_kv, capacity, self.head_dim), dtype=self.dtype, device=self.device
        )
        self.length = 0  # rows of the cache that hold committed context

    @staticmethod
    def supports(model) -> bool:
        """Whether ``forward_segments`` computes exactly what the model's own forward does: Llama-style
        decoder layers (q/k/v/o projections, with or without biases; Qwen3's per-head q/k norms;
        gated MLP; the model's own embedding and norm modules, so Gemma's scaled embedding and
        1 + weight norms too), rotary embeddings over the whole head on every layer, full attention (no
        sliding window), and a plain linear head (tied or not). Anything else goes to the generic
        backend."""
        cfg = model.config
        if getattr(cfg, "model_type", "") not in {"llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma"}:
            return False
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
            return False
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return False
        if not all(getattr(cfg, "no_rope_layers", None) or [1]):  # SmolLM3: some layers skip RoPE
            return False
        rope = getattr(cfg, "rope_parameters", None) or {}
        if float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            return False
        if any(getattr(cfg, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
            return False
        head = getattr(model, "lm_head", None)
        if head is None or getattr(head, "bias", None) is not None:
            return False
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            mlp = getattr(layer, "mlp", None)
            if not (
                attn is not None
                and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling"))
                and hasattr(attn, "q_norm") == hasattr(attn, "k_norm")
                and mlp is not None
                and all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn"))
                and hasattr(layer, "input_layernorm")
                and hasattr(layer, "post_attention_layernorm")
            ):
                return False
        return True

    def _ensure_capacity(self, needed: int) -> None:
        cap = self.cache.shape[3]
        if needed <= cap:
            return
        new_cap = max(needed, cap * 2)
        grown = torch.empty((*self.cache.shape[:3], new_cap, self.head_dim), dtype=self.dtype, device=self.device)
        grown[:, :, :, : self.length] = self.cache[:, :, :, : self.length]
        self.cache = grown

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """tokens, positions: [n] int64; mask: [n, length + n] bool or None (= attend everything).

        Writes the new K/V rows at [length, length + n) without committing them; returns
        final-normed hidden states [n, hidden].
        """
        return forward_segments([(self, tokens, positions, mask)])[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, V]."""
        return _mm(hidden, self.lm_head_w, None)

    def commit(self, keep: list[int] | None, n_new: int) -> None:
        """Keeps the new rows at offsets ``keep`` (ascending; None = all ``n_new``), drops the rest."""
        past = self.length
        if keep is None:
            self.length = past + n_new
            return
        m = len(keep)
        if keep != list(range(m)):
            idx = torch.tensor(keep, dtype=torch.long, device=self.device) + past
            self.cache[:, :, :, past : past + m] = self.cache[:, :, :, idx]
        self.length = past + m

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


@torch.inference_mode()
def forward_segments(segments) -> list[torch.Tensor]:
    """Several sessions' new tokens in one pass over the weights.

    ``segments``: ``(backend, tokens [n], positions [n], mask [n, length + n] or None)`` of
    FastLlamaBackends of one model. Every projection and MLP runs once over all rows (the weights
    are read once: the point of batching); attention runs per segment over its own cache and mask,
    so no row ever sees another session's tokens. Returns each segment's hidden states.
    """
    b0 = segments[0][0]
    dev = b0.device
    sizes = [seg[1].shape[0] for seg in segments]
    n = sum(sizes)
    spans, start = [], 0
    for size, (b, _, _, mask) in zip(sizes, segments):
        b._ensure_capacity(b.length + size)
        spans.append((b, start, start + size, b.length, None if mask is None else _additive(mask, b.dtype, dev)))
        start += size
    tokens = torch.cat([seg[1] for seg in segments]).to(dev)
    positions = torch.cat([seg[2] for seg in segments]).to(dev)
    x = b0.embed(tokens)[None]  # [1, n, hidden]
    cos, sin = b0.rotary(x, positions[None])  # [1, n, head_dim]
    cos, sin = cos[:, None], sin[:, None]
    for i, layer in enumerate(b0.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = layer.input_layernorm(x)[0]  # [n, hidden]
        q = _linear(h, attn.q_proj).view(1, n, b0.n_heads, b0.head_dim).transpose(1, 2)
        k = _linear(h, attn.k_proj).view(1, n, b0.n_kv, b0.head_dim).transpose(1, 2)
        v = _linear(h, attn.v_proj).view(1, n, b0.n_kv, b0.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
            q = attn.q_norm(q.transpose(1, 2)).transpose(1, 2)
            k = attn.k_norm(k.transpose(1, 2)).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        outs = []
        for b, s, e, past, mask in spans:
            total = past + e - s
            kv = b.cache[i]
            kv[0, :, past:total] = k[0, :, s:e]
            kv[1, :, past:total] = v[0, :, s:e]
            outs.append(F.scaled_dot_product_attention(
                q[:, :, s:e],
                kv[0, :, :total][None],
                kv[1, :, :total][None],
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=b0.n_kv != b0.n_heads,
            ))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        x = x + _linear(o.transpose(1, 2).reshape(n, -1), attn.o_proj)[None]
        h = layer.post_attention_layernorm(x)[0]
        x = x + _linear(mlp.act_fn(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)[None]
    hidden = b0.norm(x)[0]
    return list(hidden.split(sizes)) if len(sizes) > 1 else [hidden]


# Beyond a few rows MKL's skinny GEMM gets irregular here (at one thread: 6 rows 71 ms, 12 rows
# 137 ms for a whole forward's projections, against 64 and 80 ms with oneDNN's), and oneDNN's
# matmul, on the same dense weights (no second copy), is faster and smooth in the row count.
_MKL_MAX_ROWS = 4
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] -> [n, out]. For 2+ rows MKL runs ``W @ x.T`` (one tall GEMM) much faster than
    ``x @ W.T`` on a CPU. A single row on a CPU is computed as two: MKL's GEMV reads the weights
    at ~12 GB/s here, its two-column GEMM at ~19 GB/s (a whole SmolLM2-135M forward's
    projections: 47 ms vs 30 ms at one thread)."""
    if x.shape[0] == 1:
        if not x.is_cpu:
            return F.linear(x, weight, bias)
        x = torch.cat((x, x))
        y = (weight @ x.t())[:, :1].t()
        return y if bias is None else y + bias
    if x.shape[0] > _MKL_MAX_ROWS and _ONEDNN_LINEAR is not None and x.is_cpu:
        return _ONEDNN_LINEAR(x.contiguous(), weight, bias, "none", [], "")
    # Contiguous rows first: this function returns transposed views, and elementwise ops keep that
    # layout, so the next projection (the MLP's down_proj) would get ``x.t()`` contiguous and MKL's
    # plain GEMM for few columns, ~6x slower here than the transposed-B one (1.07 ms vs 0.18 ms for
    # a 1536x576 weight and 2 rows).
    y = (weight @ x.contiguous().t()).t()
    return y if bias is None else y + bias


def _linear(x: torch.Tensor, layer) -> torch.Tensor:
    """A decoder projection with contiguous rows out: the heads viewed from it must have a unit
    stride in ``head_dim``, or CPU SDPA leaves its flash kernel for the unfused math path."""
    return _mm(x, layer.weight, layer.bias).contiguous()


def _additive(mask: torch.Tensor, dtype, device) -> torch.Tensor:
    """Bool mask [n, m] (True = attend) -> additive [1, 1, n, m]: with a float mask, CPU SDPA keeps
    its flash kernel instead of the unfused math path (bmm + softmax: ~4x the attention time)."""
    out = torch.zeros(mask.shape, dtype=dtype, device=device)
    out.masked_fill_(~mask.to(device), float("-inf"))
    return out[None, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
