"""The "llama" backend: a hand-written forward for Llama-family models over a preallocated cache.

Like every backend (``verifier/backend.py``) it answers one question: given ``n`` new tokens, their
positions and which cached or new tokens each may attend to, return the final hidden states of the
new tokens and keep their K/V rows in the cache so that the accepted ones can be kept and the rest
dropped.

``LlamaBackend`` runs the decoder layers of a Llama-family model (Llama, Mistral, Qwen2/3, SmolLM3,
Gemma, Gemma 2, Gemma 3, Phi-3) directly on the model's own weights and modules, with a preallocated
KV cache that is compacted in place. On a CPU this is what makes tree verification cheap: no cache concatenation per
step, no generic mask construction, and projections run by the kernels measured fastest on this
machine for each row count (``verifier/kernels.py``). ``forward_segments`` runs several sessions'
new tokens in one pass over the weights, one decoder layer at a time (``decoder_block``). In
reduced precision the forward is batch invariant: a row's bits do not depend on what else shares
the call. There, where every projection runs a native row-invariant kernel, the whole decoder is one
native call (``native.Decoder``, ``native_layer.c``: float32 residual stream and activations, only
weights and the KV cache half width) for every forward of the model, prompts included; other
models and plans run the layers op by op (``decoder_block``) for every forward. Models it does not
implement go to the "hf" backend (``verifier/hf.py``).
"""

from __future__ import annotations

import types
import weakref

import torch
import torch.nn.functional as F

from . import layouts, native
from .backend import kept_rows
from .gguf_blocks import cache_dtype, kept
from .machine import cpu_identity
from .tuning import kernel_plan

# mask: [n, past_len + n] bool, True = may attend.


class LlamaBackend:
    """Decoder forward over a preallocated per-session KV cache [layers, 2, kv_heads, capacity, head_dim]."""

    chain_only = False  # verifies whole trees

    def __init__(self, model, capacity: int = 1024):
        """``capacity``: rows allocated now. The verifier's core passes 0 and sets ``reserved_rows``
        (the rows KV memory reserved for this cache): the cache then grows to exactly that."""
        self.model = model
        self.plan = kernel_plan(model, held_ok=True)
        self.invariant = self.plan.invariant
        inner = model.model
        cfg = model.config
        self.layers = list(inner.layers)
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        # Per layer: its sliding window (None: full attention), the rotary table it reads (Gemma 3's
        # local and global layers have their own; None: the model's one) and its attention logits'
        # soft cap (Gemma 2; None: none).
        self.windows = _windows(model)
        self.rope_kinds = _rope_kinds(model)
        self.softcaps = _softcaps(model)
        self.final_softcap = _final_softcap(model)
        self.partial_rotary = cfg.model_type == "phi3"  # rotary over the head's first dims where it says so
        self.lm_head_w = model.lm_head.weight  # [V, hidden]
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.dtype = self.lm_head_w.dtype
        self.kv_dtype = cache_dtype(model)  # float16 for GGUF blocks, else the model's
        self.device = self.lm_head_w.device
        # Invariant attention over the cache in place (native_attention.c) where it is built (a window
        # is a row's keys named by index; soft-capped scores on its vector path); else each row's keys
        # gathered and padded to whole blocks (any device).
        self.native_attention = (
            self.invariant
            and native.attention_usable(self.kv_dtype, self.device, self.head_dim)
            and (
                not any(self.softcaps)
                or native.attention_path(self.kv_dtype, self.n_heads, self.n_kv, self.head_dim) == "vector"
            )
        )
        # Zeroed: invariant attention reads masked keys past a row's own, which must be finite.
        self.cache = torch.zeros(
            (len(self.layers), 2, self.n_kv, capacity, self.head_dim), dtype=self.kv_dtype, device=self.device
        )
        self.length = 0  # rows of the cache that hold committed context
        self.reserved_rows: int | None = None  # None: grow by doubling (no reservation to answer to)
        self._rope: dict = {}  # invariant mode: (dtype, rotary kind) -> (cos, sin) by position
        self._op_by_op = False  # True: never the native decoder (``fused = None``)

    @property
    def fused(self) -> native.Decoder | None:
        """Reduced precision with native kernels throughout: every layer in one native call (float32
        residual stream and activations), the model's decoder. None: the layers run op by op."""
        return None if self._op_by_op else _model_decoder(self)

    @fused.setter
    def fused(self, value: None) -> None:
        """``None``: this session runs the layers op by op (a negative control of the native decoder)."""
        if value is not None:
            raise ValueError("a session's native decoder is the model's; it can only be switched off (None)")
        self._op_by_op = True

    _ROPE_CHUNK = 256

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype | None = None, kind: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, n, rotary dims] of ``positions`` (in ``dtype``, default the model's; ``kind``:
        the layer type whose rotary values, for a model with one table per layer type) from a table
        computed in fixed chunks of positions, so a position's values never depend on which other
        positions share the call."""
        dtype = dtype or self.dtype
        need = int(positions.max()) + 1
        table = self._rope.get((dtype, kind))
        have = 0 if table is None else table[0].shape[0]
        if need > have:
            dummy = torch.zeros((1, 1, self.head_dim), dtype=dtype, device=self.device)
            parts = [
                self.rotary_of(dummy, torch.arange(s, s + self._ROPE_CHUNK, device=self.device)[None], kind)
                for s in range(have, need, self._ROPE_CHUNK)
            ]
            cos = torch.cat([p[0][0] for p in parts])
            sin = torch.cat([p[1][0] for p in parts])
            table = (cos, sin) if table is None else (torch.cat((table[0], cos)), torch.cat((table[1], sin)))
            self._rope[(dtype, kind)] = table
        return table[0][positions][None], table[1][positions][None]

    def rotary_of(self, x: torch.Tensor, positions: torch.Tensor, kind: str | None) -> tuple[torch.Tensor, ...]:
        """The model's rotary module over ``positions`` [1, n]: its table for layer type ``kind``
        (Gemma 3: local and global layers), or its only one (``kind`` None)."""
        return self.rotary(x, positions) if kind is None else self.rotary(x, positions, kind)

    @staticmethod
    def supports(model) -> bool:
        """Whether ``forward_segments`` computes exactly what the model's own forward does: Llama-style
        decoder layers (q/k/v/o projections, with or without biases, or Phi-3's fused ``qkv_proj``;
        Qwen3's and Gemma 3's per-head q/k norms; a gated MLP, or Phi-3's fused ``gate_up_proj``; the
        model's own embedding and norm modules, so Gemma's scaled embedding and 1 + weight norms too,
        and Gemma 2/3's norms after attention and around the MLP), rotary embeddings on every layer
        (over the whole head; Phi-3's over part of it) whose frequencies do not depend on the
        sequence's length (no dynamic or longrope scaling), Gemma 3's local and global rotary tables,
        full attention, or sliding windows per layer for Gemma 2, Gemma 3 and Phi-3 (``layer_types``,
        ``sliding_window``), Gemma 2's soft-capped attention scores, a plain linear head (tied or not)
        and Gemma 2/3's soft-capped logits. Anything else goes to the "hf" backend (``unsupported``
        says why)."""
        return not LlamaBackend.unsupported(model)

    @staticmethod
    def unsupported(model) -> str:
        """Why ``supports(model)`` is False, in a few words ("" where it is True)."""
        cfg = model.config
        family = getattr(cfg, "model_type", "")
        types = getattr(cfg, "layer_types", None) or []
        if family in _WINDOWED:
            if any(t not in ("full_attention", "sliding_attention") for t in types):
                return "layers other than full or sliding-window attention"
            if getattr(cfg, "use_bidirectional_attention", False):
                return "bidirectional attention"
        else:
            if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
                return "sliding-window layers"
            if any(t != "full_attention" for t in types):
                return "layers other than full attention"
        if not all(getattr(cfg, "no_rope_layers", None) or [1]):  # SmolLM3: some layers skip RoPE
            return "layers without RoPE"
        rope = getattr(cfg, "rope_parameters", None) or {}
        ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # Gemma 3: one per layer type
        partial = float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0 and family != "phi3":
            return "RoPE over part of the head"
        for r in ropes:
            if r.get("rope_type") in ("dynamic", "longrope"):
                return f"{r['rope_type']} RoPE scaling (frequencies that depend on the sequence's length)"
        if any(getattr(cfg, a, None) for a in ("logit_scale", "logits_scaling")):
            return "scaled logits"
        if getattr(cfg, "final_logit_softcapping", None) and family not in _SOFTCAPPED:
            return "soft-capped logits"
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
            return "a decoder of another shape"
        head = getattr(model, "lm_head", None)
        if head is None or getattr(head, "bias", None) is not None:
            return "an output layer with a bias"
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            mlp = getattr(layer, "mlp", None)
            if not (
                attn is not None
                and (
                    all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj"))
                    or (family == "phi3" and hasattr(attn, "qkv_proj"))
                )
                and all(hasattr(attn, p) for p in ("o_proj", "scaling"))
                and hasattr(attn, "q_norm") == hasattr(attn, "k_norm")
                and mlp is not None
                and (
                    all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "act_fn"))
                    or (family == "phi3" and all(hasattr(mlp, p) for p in ("gate_up_proj", "activation_fn")))
                )
                and hasattr(mlp, "down_proj")
                and hasattr(layer, "input_layernorm")
                and hasattr(layer, "post_attention_layernorm")
                and hasattr(layer, "pre_feedforward_layernorm") == hasattr(layer, "post_feedforward_layernorm")
            ):
                return "fused or differently shaped projections"
        if family not in _FAMILIES:
            return "a family the llama backend does not implement"
        return ""

    @property
    def capacity(self) -> int:
        return self.cache.shape[3]

    def pad_rows(self) -> int:
        """Rows a forward writes past its tokens' own (gathered invariant attention reads whole key
        blocks; the native one reads exactly a row's keys)."""
        return _KEY_BLOCK if self.invariant and not self.native_attention else 0

    def _ensure_capacity(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        if self.reserved_rows is not None:  # the core reserved the bytes for this growth beforehand
            self.resize(max(needed, self.reserved_rows))
        else:
            self.resize(max(needed, cap * 2))

    def resize(self, rows: int) -> None:
        """Reallocates the cache to exactly ``max(rows, length)`` rows, keeping the committed ones:
        a trimmed or idle cache gives its spare rows back."""
        rows = max(rows, self.length)
        if rows == self.capacity:
            return
        new = torch.zeros((*self.cache.shape[:3], rows, self.head_dim), dtype=self.kv_dtype, device=self.device)
        new[:, :, :, : self.length] = self.cache[:, :, :, : self.length]
        self.cache = new

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, rows_exact: bool = True
    ) -> torch.Tensor:
        """tokens, positions: [n] int64; mask: [n, length + n] bool or None (= attend everything).

        Writes the new K/V rows at [length, length + n) without committing them; returns
        final-normed hidden states [n, hidden]. ``rows_exact=False`` (a prompt's prefill) lets
        invariant mode attend with one fused call for all rows: the same prompt gets the same bits,
        but a row's are not those it would get alone.
        """
        return forward_segments([(self, tokens, positions, mask)], rows_exact)[0]

    @property
    def head_rows_exact(self) -> bool:
        """Whether a row of ``logits`` has the same bits whatever rows share its call: the block
        kernel's (row invariant by construction), or an invariant plan's."""
        return getattr(self.model.lm_head, "racer_blocks", None) is not None or self.invariant

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, V] (an output layer kept as GGUF blocks: the block kernel),
        soft-capped as the model's head caps them (Gemma 2: ``final_logit_softcapping``)."""
        blocks = getattr(self.model.lm_head, "racer_blocks", None)
        out = blocks.matmul(hidden) if blocks is not None else self.plan.mm(hidden, self.lm_head_w, None)
        cap = self.final_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    def take_prefix(self, src: "LlamaBackend", rows: int) -> None:
        """An empty cache takes ``src``'s first ``rows`` committed rows as its committed context (a
        prompt prefix both sessions begin with, prefilled once: ``engine.prefill_batch``)."""
        if self.length or src.length < rows:
            raise ValueError(f"take_prefix: {rows} rows into a cache of {self.length}, from one of {src.length}")
        self._ensure_capacity(rows)
        self.cache[:, :, :, :rows] = src.cache[:, :, :, :rows]
        self.length = rows

    @property
    def prefix_exact(self) -> bool:
        """Whether rows copied from another cache (the prefix cache) are the rows this cache's own
        prefill would write: in float32 (token identity with Hugging Face is the contract there, as
        for a chunked prefill), and in reduced precision where every prompt row is computed exactly,
        as a one-token step computes it (the native decoder: row-invariant projections and native
        attention). The op-by-op invariant path attends over a prompt in one fused call, whose rows
        depend on the call's split: there a cached prefix would change bits, so it is not used."""
        return not self.invariant or (self.native_attention and self.fused is not None)

    def read_rows(self, start: int, end: int) -> torch.Tensor:
        """A copy of committed rows [start, end): [layers, 2, kv_heads, end - start, head_dim]."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"read_rows: [{start}, {end}) of a cache of {self.length}")
        return self.cache[:, :, :, start:end].clone()

    def write_rows(self, rows: torch.Tensor, skip: int = 0) -> None:
        """Appends ``rows`` (as ``read_rows`` gives them) but their first ``skip`` as committed context."""
        n = rows.shape[3] - skip
        self._ensure_capacity(self.length + n)
        self.cache[:, :, :, self.length : self.length + n] = rows[:, :, :, skip:]
        self.length += n

    def commit(self, keep: list[int] | None, n_new: int) -> None:
        """Keeps the new rows at offsets ``keep`` (ascending; None = all ``n_new``), drops the rest
        (rows past ``length`` are never read: dropping them is moving ``length`` only)."""
        past = self.length
        m, gather = kept_rows(keep, n_new)
        if gather:
            idx = torch.tensor(keep, dtype=torch.long, device=self.device) + past
            self.cache[:, :, :, past : past + m] = self.cache[:, :, :, idx]
        self.length = past + m

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


@torch.inference_mode()
def forward_segments(segments, rows_exact: bool = True) -> list[torch.Tensor]:
    """Several sessions' new tokens in one pass over the weights.

    ``segments``: ``(backend, tokens [n], positions [n], mask [n, length + n] or None)`` of
    LlamaBackends of one model. Every projection and MLP runs once over all rows (the weights
    are read once: the point of batching); attention runs per segment over its own cache and mask,
    so no row ever sees another session's tokens. Returns each segment's hidden states.

    In invariant mode (reduced precision) a row's bits do not depend on the other rows of the call:
    projections run by row-invariant kernels (``kernels.KernelPlan``), rotary values come from a
    per-position table, norms and elementwise ops are rowwise, and (``rows_exact``) each row attends
    over exactly the keys it may see in position order, by the same computation a one-token step at
    its position makes. On a CPU with the native library that is ``native_attention.c``: keys
    reduced in fixed blocks at absolute positions, block states merged in order, the committed
    context read in place by every row and only a row's ancestors named by index (``_row_keys``);
    elsewhere each row is one query over its keys gathered (``_row_groups``). A sliding-window layer's
    row sees the keys of its own path within the window (``_windowed``), the same keys a one-token
    step at its position sees; soft-capped scores (Gemma 2) take the native attention's vector path
    where it runs, else torch computes them, each row of an exact call alone (``_capped_rows``).
    """
    b0 = segments[0][0]
    fused = b0.fused is not None and b0.invariant and b0.native_attention
    exact = b0.invariant and (rows_exact or fused)
    sizes = [seg[1].shape[0] for seg in segments]
    spans = _spans(segments, sizes, exact)
    tokens = torch.cat([seg[1] for seg in segments]).to(b0.device)
    positions = torch.cat([seg[2] for seg in segments]).to(b0.device)
    if fused:
        hidden = _fused_forward(b0, tokens, positions, spans)
        return list(hidden.split(sizes)) if len(sizes) > 1 else [hidden]
    x = _embed(b0, tokens)[None]  # [1, n, hidden]
    ropes = {}
    for kind in dict.fromkeys(b0.rope_kinds):
        if b0.invariant:
            cos, sin = b0.rope(positions, kind=kind)
        else:
            cos, sin = b0.rotary_of(x, positions[None], kind)  # [1, n, rotary dims]
        ropes[kind] = (cos[:, None], sin[:, None])
    for i, layer in enumerate(b0.layers):
        x = decoder_block(b0, i, layer, x, ropes[b0.rope_kinds[i]], spans, exact)
    hidden = b0.norm(x)[0]
    return list(hidden.split(sizes)) if len(sizes) > 1 else [hidden]


def _fused_forward(b0, tokens: torch.Tensor, positions: torch.Tensor, spans) -> torch.Tensor:
    """Every layer and the final norm in one native call (``native.Decoder``): [n, hidden] in the
    model's dtype. Every call attends exactly (a prompt's rows too): one computation for every row."""
    x = _embed(b0, tokens).float().contiguous()
    kinds = list(dict.fromkeys(b0.rope_kinds))  # one rotary table, or Gemma 3's two
    tables = [b0.rope(positions, torch.float32, kind=kind) for kind in kinds]
    (cos, sin), (cos2, sin2) = tables[0], tables[-1]
    window = next((w for w in b0.windows if w is not None), None)
    segments = [(s, e, b.cache, past, *hows[None], *(hows[window] if window else ())) for b, s, e, past, hows in spans]
    cos2, sin2 = cos2[0].contiguous(), sin2[0].contiguous()
    return b0.fused(x, cos[0].contiguous(), sin[0].contiguous(), segments, cos2, sin2).to(b0.dtype)


def _embed(b, tokens: torch.Tensor) -> torch.Tensor:
    """The embedded rows of ``tokens``: the module's own lookup, or, for an embedding tied to an output
    layer stored as panels (``verifier/layouts.py``; a plain lookup, the tuner stores no other so),
    the same rows read from the panels."""
    if layouts.stored_as(b.embed.weight) != layouts.PANEL:
        return b.embed(tokens)
    if type(b.embed) is not torch.nn.Embedding:
        raise TypeError(f"{type(b.embed).__name__} over a weight stored as panels")
    return layouts.embedding(b.embed.weight, tokens)


_FUSED_TYPES = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text", "phi3"}
_FUSED_NORMS = {
    "LlamaRMSNorm",
    "MistralRMSNorm",
    "Qwen2RMSNorm",
    "Qwen3RMSNorm",
    "SmolLM3RMSNorm",
    "Gemma2RMSNorm",
    "Gemma3RMSNorm",
    "Phi3RMSNorm",
}


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (plan, moves, its decoder)


def _model_decoder(b) -> native.Decoder | None:
    """The model's native decoder for ``b``'s plan, built once and shared by every session of the
    model (its weights and norms are the model's; each call brings its own caches), built again if
    a weight was given new memory since. Held beside the model, not on it: a copy of the model must
    not read the original's weights."""
    held = _DECODERS.get(b.model)
    if held is None or held[0] is not b.plan or held[1] != layouts.moves():
        held = _DECODERS[b.model] = (b.plan, layouts.moves(), _fused_decoder(b))
    return held[2]


def _fused_decoder(b) -> native.Decoder | None:
    """The native decoder for ``b``'s model, or None where it would not compute what the layers do
    op by op (then they run so on every call): reduced precision on the invariant path with native
    attention (its vector path), RMSNorms of one epsilon (Qwen3's and Gemma 3's per-head q/k norms,
    Gemma 3's norms of the attention's and the MLP's outputs included), SiLU- or GELU-gated MLPs, a
    lookup embedding (Gemma's scaled one included), at most one sliding window and two rotary tables
    (Gemma 3's local and global layers), one soft cap of the attention scores or none (Gemma 2's),
    rotary over whole heads or their first dims (Phi-3's partial rotary factor), and every projection
    planned on a widening native tile, unchunked."""
    cfg, inner = b.model.config, b.model.model
    half = b.dtype in (torch.bfloat16, torch.float16)
    if not (b.invariant and b.native_attention and (half or kept(b.model) is not None)):
        return None
    act = _ACTIVATIONS.get(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", ""))
    if cfg.model_type not in _FUSED_TYPES or act is None or not _attends_natively(b):
        return None
    head_norms = all(hasattr(layer.self_attn, "q_norm") and hasattr(layer.self_attn, "k_norm") for layer in b.layers)
    if not head_norms and any(hasattr(layer.self_attn, n) for layer in b.layers for n in ("q_norm", "k_norm")):
        return None
    sandwich = all(hasattr(layer, "pre_feedforward_layernorm") for layer in b.layers)  # Gemma 3's
    norms = [inner.norm] + [m for layer in b.layers for m in _layer_norms(layer, head_norms, sandwich).values()]
    eps = {getattr(m, "variance_epsilon", getattr(m, "eps", None)) for m in norms}
    if len(eps) != 1 or None in eps or any(type(m).__name__ not in _FUSED_NORMS for m in norms):
        return None
    if not isinstance(b.embed, torch.nn.Embedding):
        return None
    if native.attention_path(b.kv_dtype, b.n_heads, b.n_kv, b.head_dim) != "vector":
        return None
    layers = _decoder_layers(b, head_norms, sandwich)
    if layers is None:
        return None
    chosen = b.plan.source != "forced"  # a plan forced by RACER_KERNELS is run as forced
    tiles = {  # a fused weight's parts run the tile of its shape
        p: _decoder_tile(b.plan.shapes.get(getattr(m, "full_shape", tuple(m.weight.shape))), chosen)
        for p, m in layers[0][2].items()
    }
    if None in tiles.values():
        return None
    scales = {float(layer.self_attn.scaling) for layer in b.layers}
    if len(scales) != 1:
        return None
    dims = {
        "hidden": cfg.hidden_size,
        "heads": b.n_heads,
        "kv_heads": b.n_kv,
        "head_dim": b.head_dim,
        "inter": layers[0][2]["gate_proj"].weight.shape[0],
    }
    try:
        return native.Decoder(
            layers,
            tiles,
            _norm_weight(inner.norm),
            dims,
            eps.pop(),
            scales.pop(),
            act,
            softcap=b.softcaps[0],
            rot_dim=_rot_dim(b),
        )
    except TypeError:
        return None


def _attends_natively(b) -> bool:
    """Whether the native decoder's attention is the layers': one soft cap of the scores for every
    layer or none, at most one sliding window and two rotary tables, over an even number of each
    head's dims (all, or Phi-3's partial rotary factor's first ones)."""
    if len(set(b.softcaps)) > 1 or len(set(b.windows) - {None}) > 1 or len(set(b.rope_kinds)) > 2:
        return False
    rot = _rot_dim(b)
    return rot % 2 == 0 and 2 <= rot <= b.head_dim and (rot == b.head_dim or b.partial_rotary)


def _rot_dim(b) -> int:
    """The dims of each head the rotary embedding turns: the width of its tables."""
    return b.rope(torch.zeros(1, dtype=torch.long), torch.float32, kind=b.rope_kinds[0])[0].shape[-1]


def _decoder_layers(b, head_norms: bool, sandwich: bool) -> list | None:
    """Per layer the native decoder's ``(norm1, norm2, projections, extra)`` (``native.Decoder``);
    None where a layer's projections cannot be given (``_projections``)."""
    kinds = list(dict.fromkeys(b.rope_kinds))
    layers = []
    for i, layer in enumerate(b.layers):
        w = {k: _norm_weight(m) for k, m in _layer_norms(layer, head_norms, sandwich).items()}
        extra = {k: w[k] for k in ("qnorm", "knorm", "post_attn", "post_ffn") if k in w}
        extra.update(windowed=int(b.windows[i] is not None), rope=kinds.index(b.rope_kinds[i]))
        projections = _projections(layer, b)
        if projections is None:
            return None
        layers.append((w["norm1"], w["norm2"], projections, extra))
    return layers


# The MLP activations the native decoder computes: 0 SiLU, 1 GELU's tanh approximation.
_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}
# RMSNorms that scale by 1 + weight (Gemma's) rather than by the weight.
_PLUS_ONE_NORMS = {"Gemma2RMSNorm", "Gemma3RMSNorm"}


def _layer_norms(layer, head_norms: bool, sandwich: bool) -> dict:
    """A layer's RMSNorm modules by their place in the native decoder: ``norm1`` before attention,
    ``norm2`` before the MLP; ``qnorm``/``knorm`` per head; with ``sandwich`` (Gemma 3) the MLP's input
    norm is ``pre_feedforward_layernorm`` and ``post_attn``/``post_ffn`` norm the two outputs."""
    out = {"norm1": layer.input_layernorm}
    if sandwich:
        out.update(
            norm2=layer.pre_feedforward_layernorm,
            post_attn=layer.post_attention_layernorm,
            post_ffn=layer.post_feedforward_layernorm,
        )
    else:
        out["norm2"] = layer.post_attention_layernorm
    if head_norms:
        out.update(qnorm=layer.self_attn.q_norm, knorm=layer.self_attn.k_norm)
    return out


def _norm_weight(m) -> torch.Tensor:
    """What an RMSNorm multiplies the normed row by, float32: its weight, or 1 + its weight (Gemma's,
    as it computes it)."""
    w = m.weight.detach().float()
    return 1.0 + w if type(m).__name__ in _PLUS_ONE_NORMS else w


def _decoder_tile(sp, chosen: bool) -> str | None:
    """The native tile a projection runs in the native decoder: the plan's where it is a widening
    native one; else, for a plan the tuner chose (``chosen``: a chunked kernel timed faster alone,
    where the native decoder saves the calls around it), the widening native tile measured fastest
    for one row. None without a plan, or for a forced plan of other kernels."""
    if sp is None:
        return None
    if sp.layout == layouts.PANEL or (sp.kernel in native.VARIANTS and sp.kernel not in native.PAIRS):
        return sp.kernel
    if not chosen:
        return None
    usable = [k for k in native.VARIANTS if k not in native.PAIRS and native.usable(k, cpu_identity())]
    timed = {t.kernel: v for t, v in sp.ms.items() if t.rows == 1 and not t.forward and t.kernel in usable}
    return min(timed, key=timed.get) if timed else (usable[0] if usable else None)


_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _projections(layer, b=None) -> dict | None:
    """A layer's projections by ``native.PROJECTIONS`` name. Phi-3's fused ``qkv_proj`` and
    ``gate_up_proj`` give theirs as row ranges of the one weight (its GGUF blocks' too, sharing the
    bytes; ``b``, the backend, has the head counts); None where a range cannot be cut (a packed group,
    or a weight stored other than as rows)."""
    attn, mlp = layer.self_attn, layer.mlp
    if not (hasattr(attn, "qkv_proj") or hasattr(mlp, "gate_up_proj")):
        return {p: getattr(attn if p in _ATTENTION_PROJECTIONS else mlp, p) for p in native.PROJECTIONS}
    dq, dkv = b.n_heads * b.head_dim, b.n_kv * b.head_dim
    inter = mlp.gate_up_proj.weight.shape[0] // 2
    parts = {
        "q_proj": (attn.qkv_proj, 0, dq),
        "k_proj": (attn.qkv_proj, dq, dq + dkv),
        "v_proj": (attn.qkv_proj, dq + dkv, dq + 2 * dkv),
        "gate_proj": (mlp.gate_up_proj, 0, inter),  # the first half of its outputs the gate, as _mlp reads them
        "up_proj": (mlp.gate_up_proj, inter, 2 * inter),
    }
    out = {"o_proj": attn.o_proj, "down_proj": mlp.down_proj}
    for name, (mod, lo, hi) in parts.items():
        if getattr(mod, "racer_blocks", None) is None and layouts.stored_as(mod.weight) != "row":
            return None  # rows of a weight stored as panels or transposed are no range of it
        bias = None if mod.bias is None else mod.bias[lo:hi]
        part = types.SimpleNamespace(weight=mod.weight[lo:hi], bias=bias, full_shape=tuple(mod.weight.shape))
        blocks = getattr(mod, "racer_blocks", None)
        if blocks is not None:
            part.racer_blocks = blocks.row_range(lo, hi)
            if part.racer_blocks is None:
                return None
        out[name] = part
    return out


def _spans(segments, sizes: list[int], exact: bool) -> list[tuple]:
    """Per segment ``(backend, first row, end row, past length, how its rows attend)``, each cache
    grown first to hold the new rows (and, for exact invariant attention, its pad rows). How its rows
    attend is by window (None: full attention; a sliding window's where the model has such layers)."""
    spans, start = [], 0
    for size, (b, _, positions, mask) in zip(sizes, segments):
        b._ensure_capacity(b.length + size + (b.pad_rows() if exact else 0))
        hows = {}
        for window in dict.fromkeys([None, *b.windows]):
            if window is not None and int(positions.max()) < window:  # every key lies within the window
                hows[window] = hows[None]
                continue
            seen = mask if window is None else _windowed(mask, b.length, positions, window)
            if exact and b.native_attention:
                hows[window] = _row_keys(seen, b.length, size)
            elif exact:
                hows[window] = _row_groups(seen, b.length, size, b.device, b.dtype)
            else:
                hows[window] = None if seen is None else _additive(seen, b.dtype, b.device)
        spans.append((b, start, start + size, b.length, hows))
        start += size
    return spans


def _windowed(mask: torch.Tensor | None, past: int, positions: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [n, past + n] (None: every key) limited to a sliding window: a row at position p sees
    a key at position k only where p - window < k (transformers' overlay). The cache's committed rows
    stand at positions 0, 1, ...; the new rows at ``positions`` (a tree node's: its depth past the
    context), so a node's window counts the positions along its own path."""
    pos = positions.cpu()
    keys = torch.cat((torch.arange(past), pos))
    near = keys[None, :] > pos[:, None] - window
    return near if mask is None else mask.cpu() & near


def decoder_block(b0, i: int, layer, x: torch.Tensor, rope, spans, exact: bool) -> torch.Tensor:
    """Decoder layer ``i`` over every segment's rows, x [1, n, hidden] -> [1, n, hidden]: attention
    over each segment's own cache, then the gated MLP, each added to the residual stream (Gemma 2/3:
    the attention's and the MLP's outputs normed before they are added, the MLP's input by
    ``pre_feedforward_layernorm``)."""
    plan, attn, mlp = b0.plan, layer.self_attn, layer.mlp
    h = layer.input_layernorm(x)[0]  # [n, hidden]
    a = _linear(plan, _attention(b0, i, attn, h, rope, spans, exact), attn.o_proj)[None]
    if hasattr(layer, "pre_feedforward_layernorm"):
        x = x + layer.post_attention_layernorm(a)
        h = layer.pre_feedforward_layernorm(x)[0]
        return x + layer.post_feedforward_layernorm(_mlp(plan, mlp, h)[None])
    x = x + a
    h = layer.post_attention_layernorm(x)[0]
    return x + _mlp(plan, mlp, h)[None]


def _mlp(plan, mlp, h: torch.Tensor) -> torch.Tensor:
    """The gated MLP over h [n, hidden]: gate and up projections, or Phi-3's one ``gate_up_proj``
    whose first half of outputs is the gate, its second the up projection."""
    if hasattr(mlp, "gate_up_proj"):
        gate, up = _linear(plan, h, mlp.gate_up_proj).chunk(2, dim=-1)
        return _linear(plan, up * mlp.activation_fn(gate), mlp.down_proj)
    return _linear(plan, mlp.act_fn(_linear(plan, h, mlp.gate_proj)) * _linear(plan, h, mlp.up_proj), mlp.down_proj)


def _attention(b0, i: int, attn, h: torch.Tensor, rope, spans, exact: bool) -> torch.Tensor:
    """h [n, hidden] -> attention output [n, heads * head_dim]; writes each segment's new K/V rows
    into its cache of layer ``i``."""
    plan, n = b0.plan, h.shape[0]
    if hasattr(attn, "qkv_proj"):  # Phi-3: q, k and v rows in one weight, in that order
        dq, dkv = b0.n_heads * b0.head_dim, b0.n_kv * b0.head_dim
        q, k, v = _linear(plan, h, attn.qkv_proj).split((dq, dkv, dkv), dim=-1)
    else:
        q, k, v = (_linear(plan, h, p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q = q.view(1, n, b0.n_heads, b0.head_dim).transpose(1, 2)
    k = k.view(1, n, b0.n_kv, b0.head_dim).transpose(1, 2)
    v = v.view(1, n, b0.n_kv, b0.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
        q = attn.q_norm(q.transpose(1, 2)).transpose(1, 2)
        k = attn.k_norm(k.transpose(1, 2)).transpose(1, 2)
    q, k = _rotated(q, rope, b0.partial_rotary), _rotated(k, rope, b0.partial_rotary)
    gqa = b0.n_kv != b0.n_heads
    window, cap = b0.windows[i], b0.softcaps[i]
    outs = [_segment_attention(span, i, q, k, v, attn.scaling, exact, gqa, window, cap) for span in spans]
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return o.transpose(1, 2).reshape(n, -1)


def _rotated(x: torch.Tensor, rope, partial: bool = False) -> torch.Tensor:
    """x [1, heads, n, head_dim] with its rotary embedding: over the whole head, or (``partial``: Phi-3's
    partial rotary factor) over its first dims, the others passed through."""
    cos, sin = rope
    d = cos.shape[-1]
    if not partial or d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    part = x[..., :d]
    return torch.cat((part * cos + _rotate_half(part) * sin, x[..., d:]), dim=-1)


def _segment_attention(
    span, i: int, q, k, v, scale: float, exact: bool, gqa: bool, window: int | None = None, cap: float | None = None
) -> torch.Tensor:
    """One segment's rows of q [1, H, n, D] over its own cache (its new K/V rows written first):
    [1, H, rows, D]. ``window``: the layer's sliding window (None: full attention); ``cap``: its
    scores' soft cap (None: none)."""
    b, s, e, past, hows = span
    how = hows[window]
    total = past + e - s
    kv = b.cache[i]
    kv[0, :, past:total] = k[0, :, s:e]
    kv[1, :, past:total] = v[0, :, s:e]
    if exact and b.native_attention:
        o = native.attention(q[0, :, s:e].transpose(0, 1), kv, *how, scale, softcap=cap)  # [n, H, D]
        return o.transpose(0, 1)[None]
    kv = kv.to(q.dtype)  # a cache kept narrower than the model (GGUF blocks: float16), widened exactly
    if exact:
        return _rows_attention(q[:, :, s:e], kv, how, scale, gqa, cap)
    if cap is not None:
        return _capped(q[:, :, s:e], kv[0, :, :total][None], kv[1, :, :total][None], how, scale, cap)
    return F.scaled_dot_product_attention(
        q[:, :, s:e], kv[0, :, :total][None], kv[1, :, :total][None], attn_mask=how, scale=scale, enable_gqa=gqa
    )


def _capped(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, add, scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores, as Gemma 2's own (eager) attention computes it: q [B, H, n, D]
    over keys and values [B, kv_heads, m, D], ``add`` an additive mask [B or 1, 1, n, m] or None:
    scores q k^T * scale, capped to cap * tanh(scores / cap), masked, softmax in float32, times the
    values. [B, H, n, D] in q's dtype. Reduced precision computes in float32 (a CPU without native
    bfloat16 products emulates them: slower, and rounded more)."""
    b, h, n, d = q.shape
    kv_heads, m = keys.shape[1], keys.shape[2]
    group = h // kv_heads  # the query heads a KV head serves (consecutive), as one matrix of rows
    qg = q.float().reshape(b, kv_heads, group * n, d)
    w = torch.matmul(qg, keys.float().transpose(2, 3)) * scale  # [b, kv_heads, group * n, m]
    w = torch.tanh(w / cap) * cap
    if add is not None:
        w = (w.view(b, kv_heads, group, n, m) + add[:, :, None]).view(b, kv_heads, group * n, m)
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, vals.float()).view(b, h, n, d).to(q.dtype)


_KEY_BLOCK = 64  # invariant attention: key counts padded to a multiple of this (masked), so rows share calls


def _row_keys(mask: torch.Tensor | None, past: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys each row sees, for native invariant attention: ``counts`` [n] (how many),
    ``inplace`` [n] (how many of them are the cache rows 0, 1, ...: the committed context, and a
    chain's own rows) and ``tail`` [n, T] (the cache rows of the others in position order: a tree
    node's ancestors past a branch). Nothing is copied but these indices."""
    if mask is None:  # every row sees every key (a one-token step): the same indices, without the mask's ops
        every = torch.full((n,), past + n, dtype=torch.long)
        return every, every.clone(), torch.zeros((n, 0), dtype=torch.long)
    mask = mask.cpu()
    counts = mask.sum(1)
    inplace = mask.to(torch.int32).cumprod(1).sum(1)
    rest = mask & (torch.arange(mask.shape[1])[None] >= inplace[:, None])
    lengths = rest.sum(1)
    rows, cols = rest.nonzero(as_tuple=True)  # row-major: each row's cache rows ascending
    tail = torch.zeros((n, int(lengths.max()) if n else 0), dtype=torch.long)
    if rows.numel():
        starts = lengths.cumsum(0) - lengths
        tail[rows, torch.arange(rows.numel()) - starts[rows]] = cols
    return counts.to(torch.long).contiguous(), inplace.to(torch.long).contiguous(), tail


def _row_groups(mask: torch.Tensor | None, past: int, n: int, dev, dtype=torch.float32) -> list:
    """Rows grouped for invariant attention. A row that sees ``t`` keys attends over ``t`` rounded up
    to ``_KEY_BLOCK`` keys, the extra ones masked: the call shape depends on its position only, so it
    is the one a one-token step at that position makes, and rows of one padded length share a call.
    ``(rows, padded, idx, additive mask [g, 1, 1, padded])``: ``idx`` None for rows that see exactly a
    cache prefix (a chain's nodes, a lone step; keys read in place), else [g, padded] cache indices
    of the keys each row sees in position order (tree nodes past a branch; gathered)."""
    if mask is None:
        mask = torch.ones((n, past + n), dtype=torch.bool)
    mask = mask.cpu()
    counts = mask.sum(1).tolist()
    prefix = (mask.cumsum(1) == torch.arange(1, mask.shape[1] + 1)).gather(1, (mask.sum(1, keepdim=True) - 1)).view(-1)
    groups: dict = {}
    for r in range(n):
        padded = -(-counts[r] // _KEY_BLOCK) * _KEY_BLOCK
        groups.setdefault((bool(prefix[r]), padded), []).append(r)
    out = []
    for (is_prefix, padded), rows in groups.items():
        add = torch.full((len(rows), 1, 1, padded), float("-inf"))
        for j, r in enumerate(rows):
            add[j, :, :, : counts[r]] = 0.0
        idx = None
        if not is_prefix:
            idx = torch.zeros((len(rows), padded), dtype=torch.long)
            for j, r in enumerate(rows):
                idx[j, : counts[r]] = mask[r].nonzero()[:, 0]
            idx = idx.to(dev)
        out.append((torch.tensor(rows, device=dev), padded, idx, add.to(device=dev, dtype=dtype)))
    return out


def _rows_attention(
    q: torch.Tensor, kv: torch.Tensor, groups, scale: float, gqa: bool, cap: float | None = None
) -> torch.Tensor:
    """q [1, H, n, D]; kv [2, kv_heads, capacity, D]. Every row is one query over its own keys, in
    calls whose every batch element has the shape a one-token step at that position has. Soft-capped
    scores (``cap``): each row in calls of its own (``_capped_rows``)."""
    out = torch.empty_like(q)
    for rows, padded, idx, add in groups:
        g = rows.shape[0]
        qr = q[0, :, rows].transpose(0, 1)[:, :, None]  # [g, H, 1, D]
        if idx is None:
            keys = kv[0, :, :padded][None].expand(g, -1, -1, -1)
            vals = kv[1, :, :padded][None].expand(g, -1, -1, -1)
        else:  # whole key rows copied (index_select), [g, kv_heads, padded, D]
            flat = idx.view(-1)
            keys = kv[0].index_select(1, flat).view(kv.shape[1], g, padded, -1).transpose(0, 1)
            vals = kv[1].index_select(1, flat).view(kv.shape[1], g, padded, -1).transpose(0, 1)
        if cap is not None:
            o = _capped_rows(qr, keys, vals, add, scale, cap)
        else:
            o = F.scaled_dot_product_attention(qr, keys, vals, attn_mask=add, scale=scale, enable_gqa=gqa)
        out[0, :, rows] = o[:, :, 0].transpose(0, 1)
    return out


def _capped_rows(qr, keys, vals, add, scale: float, cap: float) -> torch.Tensor:
    """Soft-capped attention of g rows (qr [g, H, 1, D] over keys, values [g, kv_heads, padded, D],
    ``add`` [g, 1, 1, padded]), each row alone over its keys copied contiguous: every row's calls are
    those a one-token step at its position makes, whatever the other rows (torch's batched products
    promise no bits across batch sizes). [g, H, 1, D]."""
    rows = []
    for j in range(qr.shape[0]):
        keys_j, vals_j = keys[j : j + 1].contiguous(), vals[j : j + 1].contiguous()
        rows.append(_capped(qr[j : j + 1], keys_j, vals_j, add[j : j + 1], scale, cap))
    return torch.cat(rows)


def _linear(plan, x: torch.Tensor, layer) -> torch.Tensor:
    """A decoder projection by the plan's kernel, contiguous rows out: the heads viewed from it must
    have a unit stride in ``head_dim``, or CPU SDPA leaves its flash kernel for the unfused math path.
    A projection kept as a GGUF file's blocks is read from them by the block kernel, as the native
    decoder reads it (its bias added in the kernel), never from its dequantized float32 copy."""
    blocks = getattr(layer, "racer_blocks", None)
    if blocks is not None:
        return blocks.matmul(x, layer.bias)
    return plan.mm(x, layer.weight, layer.bias).contiguous()


def _additive(mask: torch.Tensor, dtype, device) -> torch.Tensor:
    """Bool mask [n, m] (True = attend) -> additive [1, 1, n, m]: with a float mask, CPU SDPA keeps
    its flash kernel instead of the unfused math path (bmm + softmax: ~4x the attention time)."""
    out = torch.zeros(mask.shape, dtype=dtype, device=device)
    out.masked_fill_(~mask.to(device), float("-inf"))
    return out[None, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Families whose model_type the llama backend implements (``LlamaBackend.unsupported``); of them, those
# whose sliding windows it applies per layer, and those whose head soft-caps its logits.
_FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma", "gemma2", "gemma3_text", "phi3"}
_WINDOWED = {"gemma2", "gemma3_text", "phi3"}
_SOFTCAPPED = {"gemma2", "gemma3_text"}


def _windows(model) -> list[int | None]:
    """Each layer's sliding window (None: full attention): Gemma 2/3 by ``layer_types`` (their
    attention modules' ``sliding_window``), Phi-3's one window on every layer."""
    cfg = model.config
    layers = model.model.layers
    if cfg.model_type in ("gemma2", "gemma3_text"):
        return [getattr(layer.self_attn, "sliding_window", None) or None for layer in layers]
    if cfg.model_type == "phi3":
        return [getattr(cfg, "sliding_window", None) or None] * len(layers)
    return [None] * len(layers)


def _rope_kinds(model) -> list[str | None]:
    """Each layer's rotary table: its layer type where the rotary module keeps one per type (Gemma
    3's local and global bases), else None (the one table)."""
    cfg = model.config
    if cfg.model_type == "gemma3_text":
        return list(cfg.layer_types)
    return [None] * len(model.model.layers)


def _softcaps(model) -> list[float | None]:
    """Each layer's attention soft cap: Gemma 2's ``attn_logit_softcapping`` (Gemma 3's attention
    passes none to its attention function, whatever its config says), else None."""
    cfg = model.config
    cap = getattr(cfg, "attn_logit_softcapping", None) if cfg.model_type == "gemma2" else None
    return [float(cap) if cap else None] * len(model.model.layers)


def _final_softcap(model) -> float | None:
    """The logits' soft cap the model's head applies (Gemma 2/3: ``final_logit_softcapping``)."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    return float(cap) if cap and model.config.model_type in _SOFTCAPPED else None
