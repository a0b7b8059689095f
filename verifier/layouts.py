"""How a model's projection weights are stored: as loaded (rows), transposed (``col``) or as
panels (``panel``).

In float32 a shape's weight may be *stored transposed*: the same values, the module's ``weight`` a
transposed view of contiguous ``[in, out]`` storage, so no memory is added and any other reader of
the module sees the same tensor. ``x @ W.T`` is then a plain NN GEMM, which some BLAS builds run
faster than the transposed product.

In reduced precision a shape's weight may be *stored as panels* for the native panel kernel
(``verifier/native_panel.c``): the output columns in groups of the kernel's panel width, each
group's ``[in, width]`` block contiguous. The tensor keeps its ``[out, in]`` shape and size (no
memory is added) but not its meaning: only a reader that knows the layout may use it. Such a
parameter says so (``stored_as``), the kernel plan runs the panel kernel on it, an output layer
tied to the embedding is looked up through ``embedding``, and ``loaded_layout`` puts rows back for
Hugging Face's own forward.

Which layout a shape keeps is measured (``verifier/tuning.py``) and recorded in its
``kernels.ShapePlan``; this module only moves weights between them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from . import arena, native

PANEL = "panel"


def transposable(w: torch.Tensor) -> bool:
    """Whether a weight may be stored transposed: float32 on a CPU (the layouts were measured there;
    reduced precision keeps its rows for the invariant chunks)."""
    return w.device.type == "cpu" and w.dtype == torch.float32


def panelable(w: torch.Tensor) -> bool:
    """Whether a weight may be stored as panels: a bfloat16 or float16 CPU weight whose output rows
    are a whole number of the native panels, where the native kernels are built."""
    width = native.panel_width() if w.device.type == "cpu" else 0
    return width > 0 and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16) and w.shape[0] % width == 0


def stored_as(w: torch.Tensor) -> str:
    """``panel`` for a weight stored as panels, ``col`` when a 2-D weight is a transposed view of
    contiguous storage, else ``row``."""
    if getattr(w, "_racer_layout", None) == PANEL:
        return PANEL
    return "col" if arena.transposed(w) else "row"


def _panels(w: torch.Tensor) -> torch.Tensor:
    """A copy of a weight's values stored as panels, marked so."""
    n, k = w.shape
    width = native.panel_width()
    p = w.reshape(n // width, width, k).transpose(1, 2).contiguous().view(n, k)
    p._racer_layout = PANEL
    return p


def _unpanel(w: torch.Tensor) -> torch.Tensor:
    """The rows of a weight stored as panels (a copy, contiguous)."""
    n, k = w.shape
    width = native.panel_width()
    return w.detach().reshape(n // width, k, width).transpose(1, 2).reshape(n, k).contiguous()


def in_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """``w`` stored as ``layout``: itself when it already is, else a copy with the same values."""
    if stored_as(w) == layout:
        return w
    if stored_as(w) == PANEL:
        w = _unpanel(w)
    if layout == PANEL:
        return _panels(w)
    return w.t().contiguous().t() if layout == "col" else w.contiguous()


def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an embedding weight in whichever layout it is stored ([*ids.shape, in])."""
    if stored_as(weight) != PANEL:
        return torch.nn.functional.embedding(ids, weight)
    n, k = weight.shape
    width = native.panel_width()
    return weight.view(n // width, k, width)[ids // width, :, ids % width]


def _own_storage(param: torch.Tensor) -> torch.Tensor | None:
    """A flat view of the storage that holds exactly a weight's values (rows, or a transposed view),
    or None."""
    d = param.data
    base = d if d.is_contiguous() else d.t() if d.dim() == 2 and d.t().is_contiguous() else None
    if base is None or d.storage_offset() != 0 or d.untyped_storage().nbytes() != d.numel() * d.element_size():
        return None
    return base.view(-1)


def set_layout(param: torch.Tensor, layout: str) -> None:
    """Stores a weight (in place: its ``data``, so tied modules follow) as ``layout``; same values.
    The new layout is written into the memory the weight holds (its arena slot, ``verifier/arena.py``,
    or its own storage), so a pointer to it taken earlier (the native decoder's) stays valid."""
    if stored_as(param) != layout:
        value = in_layout(param, layout).detach()
        flat = arena.slot(param)
        flat = flat if flat is not None else _own_storage(param)
        if flat is None:
            global _moved
            param.data = value
            _moved += 1
        else:
            arena.place(param, flat, value)
        param._racer_layout = layout


_moved = 0  # weights given new memory by ``set_layout`` so far


def moves() -> int:
    """How many times a weight was given new memory (a pointer to its old memory then dangles)."""
    return _moved


_PROJECTIONS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")),
    ("mlp", ("gate_proj", "up_proj", "gate_up_proj", "down_proj")),
)


def layer_projections(layer) -> list[torch.nn.Module]:
    """A Llama-family decoder layer's projection modules, in the order the forward runs them (Phi-3's
    fused ``qkv_proj`` and ``gate_up_proj`` in place of the q/k/v and gate/up ones)."""
    return [
        mod
        for part, names in _PROJECTIONS
        for name in names
        if (mod := getattr(getattr(layer, part), name, None)) is not None
    ]


def projection_weights(model) -> dict[tuple[int, int], torch.Tensor]:
    """One weight per distinct projection shape of a Llama-family model (its first use)."""
    found: dict[tuple[int, int], torch.Tensor] = {}
    for mod in (*layer_projections(model.model.layers[0]), model.lm_head):
        found.setdefault(tuple(mod.weight.shape), mod.weight)
    return found


def all_projections(model) -> list[torch.nn.Parameter]:
    """Every projection weight of a Llama-family model and its output layer (tied ones once)."""
    params: dict[int, torch.nn.Parameter] = {}
    for layer in model.model.layers:
        for mod in layer_projections(layer):
            params.setdefault(id(mod.weight), mod.weight)
    params.setdefault(id(model.lm_head.weight), model.lm_head.weight)
    return list(params.values())


def apply_layouts(model, layouts: dict[tuple[int, int], str]) -> None:
    """Stores every projection weight as its shape's entry says, rows if absent (in place; same
    values). Outside inference mode, whoever calls: the parameters must stay ordinary tensors.
    Parameters created in inference mode keep their storage (swapping an inference tensor's data
    leaves it unusable); every kernel computes the same values on either layout, only the speed
    differs."""
    with torch.inference_mode(False), torch.no_grad():
        for p in all_projections(model):
            if p.is_inference():
                continue
            set_layout(p, layouts.get(tuple(p.shape), "row"))


@contextmanager
def loaded_layout(model):
    """For the block, every weight of ``model`` stored as Hugging Face loaded it (rows), then as the
    plan stored it again: Hugging Face's own forward then calls the GEMMs its users' runs call (the
    HF baselines of ``racer bench``). One weight's copy at a time, never a second model; not while a
    forward of the llama backend runs."""
    changed = {p: stored_as(p) for p in model.parameters() if stored_as(p) != "row"}
    with torch.inference_mode(False), torch.no_grad():
        for p in changed:
            set_layout(p, "row")
    try:
        yield model
    finally:
        with torch.inference_mode(False), torch.no_grad():
            for p, layout in changed.items():
                set_layout(p, layout)
