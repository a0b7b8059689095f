"""How a model's projection weights are stored: as loaded (rows) or transposed (``col``).

In float32 a shape's weight may be *stored transposed*: the same values, the module's ``weight`` a
transposed view of contiguous ``[in, out]`` storage, so no memory is added and any other reader of
the module sees the same tensor. ``x @ W.T`` is then a plain NN GEMM, which some BLAS builds run
faster than the transposed product. Which layout a shape keeps is measured (``verifier/tuning.py``)
and recorded in its ``kernels.ShapePlan``; this module only moves weights between the two.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from . import arena


def transposable(w: torch.Tensor) -> bool:
    """Whether a weight may be stored transposed: float32 on a CPU (the layouts were measured there;
    reduced precision keeps its rows for the invariant chunks)."""
    return w.device.type == "cpu" and w.dtype == torch.float32


def stored_as(w: torch.Tensor) -> str:
    """``col`` when a 2-D weight is a transposed view of contiguous storage, else ``row``."""
    return "col" if arena.transposed(w) else "row"


def in_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """``w`` stored as ``layout``: itself when it already is, else a copy with the same values."""
    if stored_as(w) == layout:
        return w
    return w.t().contiguous().t() if layout == "col" else w.contiguous()


def set_layout(param: torch.Tensor, layout: str) -> None:
    """Stores a weight (in place: its ``data``, so tied modules follow) as ``layout``; same values. A
    packed weight (``verifier/arena.py``) is written back into its own slot."""
    if stored_as(param.data) != layout:
        value = in_layout(param.data, layout)
        flat = arena.slot(param)
        if flat is None:
            param.data = value
        else:
            arena.place(param, flat, value)


def projection_weights(model) -> dict[tuple[int, int], torch.Tensor]:
    """One weight per distinct projection shape of a Llama-family model (its first use)."""
    found: dict[tuple[int, int], torch.Tensor] = {}
    layer = model.model.layers[0]
    for mod in (
        layer.self_attn.q_proj,
        layer.self_attn.k_proj,
        layer.self_attn.v_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_proj,
        layer.mlp.up_proj,
        layer.mlp.down_proj,
        model.lm_head,
    ):
        found.setdefault(tuple(mod.weight.shape), mod.weight)
    return found


def all_projections(model) -> list[torch.nn.Parameter]:
    """Every projection weight of a Llama-family model and its output layer (tied ones once)."""
    params: dict[int, torch.nn.Parameter] = {}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for mod in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
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
    changed = [p for p in model.parameters() if stored_as(p) == "col"]
    with torch.inference_mode(False), torch.no_grad():
        for p in changed:
            set_layout(p, "row")
    try:
        yield model
    finally:
        with torch.inference_mode(False), torch.no_grad():
            for p in changed:
                set_layout(p, "col")
