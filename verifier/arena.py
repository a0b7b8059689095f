"""A model's CPU weights in one block of memory, laid out in the order a forward reads them.

Every verification step streams all of a model's weights from memory, so how they sit in memory
bounds its speed as much as the kernels do. Loaded from safetensors, a weight is a view of the
file's mapping at whatever offset the file gives it (rarely a cache-line boundary), in 4 KiB pages.
``pack`` copies every parameter into one private anonymous mapping instead: each tensor starts on a
cache line, one after the other in module order (a decoder layer's projections, then the next
layer's), and the kernel is asked to back the block with huge pages (``MADV_HUGEPAGE``; honoured
where transparent huge pages are set to ``always`` or ``madvise``), so the stream crosses no page
walk every 4 KiB. The values are unchanged. On an AMD EPYC (Zen 3, AVX2) a 1-8 row pass over every
projection of the default model ran 9-19% faster packed at one thread, with the native kernels
(``scripts/bench_kernels.py`` ``/unpacked`` measures whole steps side by side on any machine).

A packed parameter remembers its slot, so storing it in another layout (``layouts.set_layout``)
writes the new layout back into the same place. ``RACER_PACK=off`` leaves the weights where they
were loaded.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every tensor starts on a cache line
_HUGE = 2 << 20  # the block itself starts on a (2 MiB) huge-page boundary


def enabled() -> bool:
    return os.environ.get("RACER_PACK", "on").lower() not in ("off", "0", "no", "false")


def transposed(w: torch.Tensor) -> bool:
    """Whether a 2-D tensor is a transposed view of contiguous storage (``layouts.stored_as`` "col")."""
    return w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous()


def packed(model) -> bool:
    return bool(getattr(model, "_racer_packed", False))


def slot(param: torch.Tensor) -> torch.Tensor | None:
    """The flat arena slot a packed parameter lives in (None if it is not packed)."""
    return getattr(param, "_racer_slot", None)


def pack(model) -> bool:
    """Moves every parameter of a CPU model into one arena (in place: each parameter's ``data``, so
    tied modules follow). Once per model; not for parameters created in inference mode (their data
    cannot be swapped) nor off a CPU. Returns whether the model is packed."""
    if packed(model):
        return True
    params = [p for p in dict.fromkeys(model.parameters()) if id(p) not in _served_as_blocks(model)]  # tied once
    if (
        not enabled()
        or not params
        or any(p.device.type != "cpu" or p.is_inference() for p in params)
        or not hasattr(mmap, "MAP_PRIVATE")
    ):
        return False
    offsets, end = [], 0
    for p in params:
        end = -(-end // _ALIGN) * _ALIGN
        offsets.append(end)
        end += p.numel() * p.element_size()
    block = mmap.mmap(-1, end + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # a kernel without transparent huge pages: 4 KiB pages, still aligned
            log.debug("no huge pages for the weights: %s", e)
    base = -torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr() % _HUGE
    with torch.inference_mode(False), torch.no_grad():
        for p, off in zip(params, offsets):
            # A storage of its own per tensor (each holds the mapping alive): code that groups
            # tensors by storage (tied-weight detection on save, safetensors) sees what it saw
            # before packing.
            flat = torch.frombuffer(block, dtype=p.dtype, count=p.numel(), offset=base + off)
            place(p, flat, p.data)
    model._racer_packed = True
    return True


def _served_as_blocks(model) -> set[int]:
    """ids of the parameters that no forward reads: the float32 weights of projections served from a
    GGUF file's blocks (``gguf_blocks.attach``: a module with ``racer_blocks``), where no other module
    shares them (a tied embedding is read by its lookups). They stay where they were loaded, a mapping
    of the converted file that nothing pages in, instead of a copy in the arena: the verifier's
    resident memory holds the blocks and not their float32 values too."""
    served: dict[int, bool] = {}
    for m in model.modules():
        blocks = getattr(m, "racer_blocks", None) is not None
        for p in m.parameters(recurse=False):
            served[id(p)] = served.get(id(p), True) and blocks and p is getattr(m, "weight", None)
    return {k for k, v in served.items() if v}


def place(param: torch.Tensor, flat: torch.Tensor, value: torch.Tensor) -> None:
    """Writes ``value`` (the parameter's values, in whichever layout) into ``flat`` in that layout's
    storage order and makes it the parameter's data: rows, or (a transposed view of contiguous
    storage) columns."""
    value = value.detach()
    if transposed(value):
        stored = flat.view(value.shape[1], value.shape[0])
        stored.copy_(value.t())
        param.data = stored.t()
    else:
        stored = flat.view(value.shape)
        stored.copy_(value)
        param.data = stored
    param._racer_slot = flat
