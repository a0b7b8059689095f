"""The kernel-plan cache: a measured choice kept per (machine, model, dtype, threads).

Tuning takes tens of seconds (``verifier/tuning.py``), so a choice is written to
``cache_root()/kernels/<digest>.json``, the digest hashing everything the choice depends on
(``key``): the machine's fingerprint, the model's shapes, the dtype, the thread count, the plan
kind, the native kernels built here and their source, whether the weights are packed, and
``VERSION``. A file of another version, another machine or another build of the kernels is thus
never read; a file that does not parse, or names a kernel this process cannot run, reads as absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from . import arena, native
from .kernels import BUCKETS, CANDIDATES, ShapePlan, Timing, reads, row_invariant, usable
from .layouts import panelable, transposable
from .machine import fingerprint
from .paths import cache_root

log = logging.getLogger(__name__)

# 3: native kernels, choices checked over a whole forward; 4: measured on packed weights;
# 5: numpy's BLAS held to one thread in a symlinked environment too (choices measured with it spinning);
# 6: the measured medians stored as records (kernel, layout, rows, forward), not as strings;
# 7: invariant plans chosen one token first (``tuning.ONE_ROW_SLACK``);
# 8: each row count timed in its own round, after a warm-up call at that count;
# 9: reduced-precision weights may be stored as panels for the native panel kernel
VERSION = 9


def key(model, weights, dtype, threads, device, invariant) -> tuple[dict, str]:
    """What a choice holds for, and its digest (the file's name)."""
    cfg = model.config
    ident = {
        "version": VERSION,
        "machine": fingerprint() if device.type == "cpu" else {"cuda": torch.cuda.get_device_name(device)},
        "model": {
            "type": getattr(cfg, "model_type", ""),
            "layers": getattr(cfg, "num_hidden_layers", 0),
            "shapes": sorted(list(s) for s in weights),
        },
        "dtype": str(dtype).replace("torch.", ""),
        "threads": threads,
        "invariant": invariant,
        "buckets": list(BUCKETS),
        "native": [n for n in native.VARIANTS if usable(n, device, dtype)],
        "native_source": native.source_digest(),
        "packed": arena.packed(model),
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return ident, digest


def path_of(digest: str) -> Path:
    return cache_root() / "kernels" / f"{digest}.json"


def read(path: Path, weights, invariant: bool) -> dict[tuple[int, int], ShapePlan] | None:
    """The cached shape plans at ``path`` if they are whole and usable here, else None."""
    w0 = next(iter(weights.values()))
    try:
        data = json.loads(path.read_text())
        shapes = {
            tuple(int(v) for v in s.split("x")): ShapePlan(
                by_bucket={int(b): str(k) for b, k in p["by_bucket"].items()},
                kernel=str(p["kernel"]),
                rows=int(p["rows"]),
                ms={Timing(str(k), str(lay), int(r), bool(fw)): float(v) for k, lay, r, fw, v in p["ms"]},
                layout=str(p["layout"]),
            )
            for s, p in data["shapes"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    movable = {"row": True, "col": not invariant and transposable(w0), "panel": invariant}
    for s, p in shapes.items():
        kernels = [p.kernel] if invariant else list(p.by_bucket.values())
        if (
            not movable.get(p.layout, False)
            or (p.layout == "panel" and (s not in weights or not panelable(weights[s])))
            or any(p.layout not in reads(k) for k in kernels if k in CANDIDATES)
            or not kernels
            or not all(k in CANDIDATES and usable(k, w0.device, w0.dtype) for k in kernels)
            or (invariant and (p.rows < 0 or (p.rows == 0 and not row_invariant(p.kernel))))
        ):
            return None
    return shapes if set(shapes) == set(weights) else None


def write(path: Path, ident: dict, shapes: dict[tuple[int, int], ShapePlan], seconds: float) -> None:
    """Writes the choice atomically (a concurrent reader sees a whole file or none); a cache that
    cannot be written is logged, not an error."""
    record = {
        "key": ident,
        "seconds": round(seconds, 2),
        "shapes": {
            f"{o}x{i}": {
                "by_bucket": p.by_bucket,
                "kernel": p.kernel,
                "rows": p.rows,
                "layout": p.layout,
                "ms": [[t.kernel, t.layout, t.rows, t.forward, v] for t, v in sorted(p.ms.items())],
            }
            for (o, i), p in shapes.items()
        },
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("kernel choice not cached: %s", e)
