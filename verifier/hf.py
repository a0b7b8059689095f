"""The "hf" backend: any decoder-only causal LM ``transformers`` generates with, by its own forward.

``HFBackend`` runs the model's own decoder (found with ``get_decoder()``, whatever attribute
holds it: ``model.model``, ``transformer``, ``gpt_neox``, ``model.decoder``...) over a
``DynamicCache`` and applies the model's own output head. Architectures differ in what they
accept, so each model gets an ``HFPlan``, decided once per model object by a probe (a few tokens,
tree verification against plain transformers forwards) rather than from a list of names:

* ``tree``: tree positions as ``position_ids`` and the tree as a 4D additive mask (a sliding-window
  layer gets the same mask limited to its window, by position). Full tree verification.
* ``chain``: the architecture takes no explicit positions or ignores a custom 4D mask (ALiBi
  models such as Bloom and MPT derive their biases from the 2D mask's token order). The backend then
  verifies chains only, with a 2D mask and contiguous positions, exactly as ``generate`` runs a
  model; the engine reduces each draft tree to its single first-child path. Still lossless, less
  speculation per round.
* neither works (recurrent or hybrid state caches that cannot drop rejected tokens, heads that do
  more than the output embeddings): ``ValueError`` at load, naming the ``model_type``.

The cache is a ``DynamicCache`` of plain full layers (no sliding-window eviction: rejected rows
are dropped by gathering the kept rows per layer, and a window is a mask, not a cache size).
"""

from __future__ import annotations

import inspect
import logging
import random
import weakref
from dataclasses import dataclass, field

import torch

from .backend import kept_rows
from .tree import tree_inputs

log = logging.getLogger(__name__)

# mask: [n, past_len + n] bool, True = may attend.

# Why a known family cannot take tree masks; the probe decides, this only words the message.
_CHAIN_REASONS = {
    "bloom": "ALiBi biases are built from the 2D attention mask's token order; it takes no position ids",
    "mpt": "ALiBi biases are built from the key index; it takes no position ids",
    "falcon": "ALiBi (alibi=True) biases are built from the 2D attention mask; it ignores position ids",
}


@dataclass
class HFPlan:
    """How a model verifies: whole trees or chains, and what its decoder takes."""

    mode: str  # "tree" or "chain"
    reason: str = ""  # why chain
    takes_positions: bool = True
    window_masks: dict = field(default_factory=dict)  # layer kind -> sliding window (None = full)
    mask_dict: bool = False  # the decoder takes {layer kind: 4D mask}


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params


def _window_kinds(config) -> tuple[dict, bool]:
    """Layer kind -> sliding window (None: full attention), and whether the decoder wants a dict."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    unknown = [k for k in kinds if k not in ("full_attention", "sliding_attention")]
    if unknown:
        raise _Unsupported(f"layer types {unknown} (only full and sliding-window attention are handled)")
    if len(kinds) > 1:
        return {k: (window if k == "sliding_attention" else None) for k in kinds}, True
    if kinds == ["full_attention"]:
        return {"full_attention": None}, False
    return {"sliding_attention" if window else "full_attention": window}, False


class _Unsupported(Exception):
    pass


class HFBackend:
    """A causal LM through ``transformers``: 4D additive tree mask and position ids (or chains), a
    DynamicCache, gather of kept rows. A ``backend.Backend``, as ``LlamaBackend`` is."""

    invariant = False  # float32 only: rows may depend on what shares a forward

    def __init__(self, model, plan: HFPlan | None = None):
        from transformers import DynamicCache

        self.model = model
        self.model_type = getattr(model.config, "model_type", type(model).__name__)
        self.decoder = model.get_decoder()
        self._head = model.get_output_embeddings()
        if self._head is None:
            raise ValueError(f"model_type={self.model_type!r}: no output embeddings (get_output_embeddings() is None)")
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._scale = getattr(cfg, "logit_scale", None)  # Cohere: logits * scale
        self._divide = getattr(cfg, "logits_scaling", None)  # Granite: logits / scaling
        self.plan = plan if plan is not None else hf_plan(model)
        self.chain_only = self.plan.mode == "chain"
        self.cache = DynamicCache()
        # transformers 5.2x renames the decoders' ``past_key_values`` argument to ``cache``
        self._cache_arg = "cache" if _accepts(self.decoder.forward, "cache") else "past_key_values"
        self.length = 0
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    # -- forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """tokens, positions: [n]; mask: [n, length + n] bool or None. Returns hidden states [n, hidden]."""
        n = tokens.shape[0]
        total = self.length + n
        dev = self.device
        kwargs = {}
        if self.plan.mode == "chain":
            if not torch.equal(positions.cpu(), torch.arange(self.length, total)):
                raise ValueError(f"model_type={self.model_type!r} verifies chains only: {self.plan.reason}")
            kwargs["attention_mask"] = torch.ones((1, total), dtype=torch.long, device=dev)
            if self.plan.takes_positions:
                kwargs["position_ids"] = positions.to(dev)[None]
        else:
            if mask is None:
                mask = torch.ones((n, total), dtype=torch.bool)
            masks = {kind: self._additive(mask, positions, window) for kind, window in self.plan.window_masks.items()}
            kwargs["attention_mask"] = masks if self.plan.mask_dict else next(iter(masks.values()))
            kwargs["position_ids"] = positions.to(dev)[None]
        kwargs[self._cache_arg] = self.cache
        out = self.decoder(input_ids=tokens.to(dev)[None], use_cache=True, **kwargs)
        return out.last_hidden_state[0]

    def _additive(self, mask: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        allowed = mask.to(self.device)
        if window:  # key k visible from query q only if pos(k) > pos(q) - window (transformers' overlay)
            pos = positions.to(self.device)
            key_pos = torch.cat((torch.arange(self.length, device=self.device), pos))
            allowed = allowed & (key_pos[None, :] > pos[:, None] - window)
        out = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        out.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return out[None, None]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, V], with the model head's own scaling and soft-capping."""
        logits = self._head(hidden)
        if self._scale is not None:
            logits = logits * self._scale
        if self._divide is not None:
            logits = logits / self._divide
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    # -- KV bookkeeping ----------------------------------------------------------------------------
    def commit(self, keep: list[int] | None, n_new: int) -> None:
        past = self.length
        m, gather = kept_rows(keep, n_new)
        if not gather:
            if m < n_new:
                self.cache.crop(-(n_new - m))
        else:
            idx = torch.tensor([*range(past), *(past + i for i in keep)], dtype=torch.long, device=self.device)
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                    continue
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)
        self.length = past + m

    @property
    def prefix_exact(self) -> bool:
        """Rows may be copied in from the prefix cache: in float32 (token identity with transformers is
        the contract, as for a chunked prefill) for models verified as trees, whose cache is plain
        keys and values per position; a chain model's may hold other state, so it prefills."""
        return self.plan.mode == "tree"

    def read_rows(self, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of committed rows [start, end): per layer (keys, values) [1, kv_heads, end - start, head_dim]."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"read_rows: [{start}, {end}) of a cache of {self.length}")
        return [
            (layer.keys[..., start:end, :].clone(), layer.values[..., start:end, :].clone())
            for layer in self.cache.layers
        ]

    def write_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor]], skip: int = 0) -> None:
        """Appends ``rows`` (as ``read_rows`` gives them) but their first ``skip`` as committed context."""
        for i, (k, v) in enumerate(rows):
            self.cache.update(k[..., skip:, :], v[..., skip:, :], i)
        self.length += rows[0][0].shape[-2] - skip

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: drop that many (transformers 5.x)
            self.length = length

    # KV memory's side of the interface. A DynamicCache holds exactly its committed rows and grows
    # per forward: no padding, nothing reserved ahead to grow to, nothing spare to give back.
    reserved_rows: int | None = None

    def pad_rows(self) -> int:
        return 0

    def resize(self, rows: int) -> None:
        pass


# -- the plan: probed once per model ------------------------------------------------------------------


def hf_plan(model) -> HFPlan:
    """Tree or chain verification for ``model`` (cached per model object); ValueError if neither
    reproduces transformers' own forward."""
    plan = _PLANS.get(model)
    if plan is None:
        plan = _probe(model)
        _PLANS[model] = plan
    return plan


def _tolerance(dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


@torch.inference_mode()
def _reference(model, seq: list[int]) -> torch.Tensor:
    """transformers' plain forward (no cache) over ``seq``: logits [len, V]."""
    dev = next(model.parameters()).device
    ids = torch.tensor([seq], device=dev)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float()


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> bool:
    got = got.float()
    scale = max(1.0, float(want.abs().max()))
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= _tolerance(dtype) * scale


@torch.inference_mode()
def _probe(model) -> HFPlan:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    try:
        decoder = model.get_decoder()
        takes_positions = _accepts(decoder.forward, "position_ids")
        windows, mask_dict = _window_kinds(model.config)
    except _Unsupported as e:
        raise ValueError(f"model_type={model_type!r} is not supported by the hf backend: {e}") from None
    dtype = next(model.parameters()).dtype
    vocab = (
        model.config.get_text_config().vocab_size
        if hasattr(model.config, "get_text_config")
        else model.config.vocab_size
    )
    rng = random.Random(1234)
    hi = min(vocab, 1000)
    ctx = [rng.randrange(hi) for _ in range(6)]
    tree_tokens = [rng.randrange(hi) for _ in range(6)]
    tree_parents = [-1, 0, 0, 1, 1, 2]
    tree_plan = HFPlan("tree", takes_positions=takes_positions, window_masks=windows, mask_dict=mask_dict)
    errors = []
    if takes_positions:
        try:
            _check_tree(model, tree_plan, ctx, tree_tokens, tree_parents, dtype)
            return tree_plan
        except Exception as e:  # noqa: BLE001 - any failure (an assertion, an error in the model) means: not this way
            errors.append(f"tree: {_describe(e)}")
    reason = _CHAIN_REASONS.get(model_type) or (
        "it takes no position ids"
        if not takes_positions
        else "it does not honour a custom 4D attention mask with tree positions"
    )
    chain_plan = HFPlan("chain", reason=reason, takes_positions=takes_positions, window_masks=windows)
    try:
        _check_chain(model, chain_plan, ctx, tree_tokens, dtype)
    except Exception as e:  # noqa: BLE001
        errors.append(f"chain: {_describe(e)}")
        raise ValueError(
            f"model_type={model_type!r} is not supported by the hf backend "
            f"(neither tree nor chain verification reproduces its own forward: {'; '.join(errors)})"
        ) from None
    log.warning(
        "model_type=%r cannot verify trees (%s); verifying chains only (the draft tree's first path)",
        model_type,
        reason,
    )
    return chain_plan


def _describe(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:160]}"


def _root_path(tokens, parents, i):
    path = []
    while i != -1:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


def _check_tree(model, plan, ctx, tokens, parents, dtype) -> None:
    b = HFBackend(model, plan)
    _prefill(b, ctx)
    positions, mask = tree_inputs(parents, b.length)
    got = b.logits(b.forward(torch.tensor(tokens), positions, mask))
    for i in range(len(tokens)):
        want = _reference(model, ctx + _root_path(tokens, parents, i))[-1]
        assert _close(got[i], want, dtype), f"tree node {i}'s logits differ from sequential decoding"
    keep = [0, 2, 5]  # not a prefix: the cache gathers rows
    b.commit(keep, len(tokens))
    kept = [tokens[i] for i in keep]
    nxt = tokens[3]
    got = b.logits(b.forward(torch.tensor([nxt]), torch.tensor([b.length]), None))[0]
    assert _close(got, _reference(model, ctx + kept + [nxt])[-1], dtype), "a gathered cache does not continue right"
    b.commit(None, 1)
    b.truncate(len(ctx) + 1)
    got = b.logits(b.forward(torch.tensor([nxt]), torch.tensor([b.length]), None))[0]
    assert _close(got, _reference(model, ctx + kept[:1] + [nxt])[-1], dtype), "a cropped cache does not continue right"


def _check_chain(model, plan, ctx, tokens, dtype) -> None:
    b = HFBackend(model, plan)
    _prefill(b, ctx)
    chain = tokens[:4]
    got = b.logits(b.forward(torch.tensor(chain), torch.arange(b.length, b.length + 4), None))
    want = _reference(model, ctx + chain)[len(ctx) :]
    assert _close(got, want, dtype), "chain logits differ from transformers' own forward"
    b.commit([0, 1], 4)  # a prefix: the cache is cropped
    nxt = tokens[5]
    got = b.logits(b.forward(torch.tensor([nxt]), torch.tensor([b.length]), None))[0]
    assert _close(got, _reference(model, ctx + chain[:2] + [nxt])[-1], dtype), "a cropped cache does not continue right"


def _prefill(b: HFBackend, ctx: list[int]) -> None:
    n = len(ctx)
    mask = torch.ones((n, n), dtype=torch.bool).tril()
    b.forward(torch.tensor(ctx), torch.arange(n), mask)
    b.commit(None, n)


def chain_of(parents: list[int], node: int = 0) -> list[int]:
    """The tree's first path from ``node`` (the root by default): always the first (lowest-index)
    child. Node indices."""
    first: dict[int, int] = {}
    for i, p in enumerate(parents):
        if p >= 0 and p not in first:
            first[p] = i
    path = [node]
    while path[-1] in first:
        path.append(first[path[-1]])
    return path
