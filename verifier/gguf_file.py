"""A GGUF file's tensors, found without reading its metadata's values.

gguf's ``GGUFReader`` makes a numpy view of every metadata value, the 49k strings of a vocabulary
included: 4-8 s on two cores for the default model, at every start of a verifier serving its blocks.
Serving needs only where each tensor lies, so this walks the metadata once (lengths only, strings
skipped) and maps the tensors' bytes in place. The format's constants (type numbers, block sizes)
are gguf's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

# bytes of one value of each fixed-size metadata type
_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
_UNSIGNED = {GGUFValueType.UINT8: "B", GGUFValueType.UINT16: "H", GGUFValueType.UINT32: "I", GGUFValueType.UINT64: "Q"}


@dataclass
class Tensor:
    name: str
    kind: str  # the GGML type's name (Q4_1, F32, ...)
    shape: tuple[int, ...]  # outermost first, as numpy orders it ([rows, row length] for a matrix)
    data: np.ndarray  # its bytes, uint8, mapped from the file (read-only)


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def skip_value(self, vtype: int) -> None:
        if vtype == GGUFValueType.STRING:
            n = self.take("Q")
            self.pos += n
        elif vtype == GGUFValueType.ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype in _SIZES:
                self.pos += _SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        elif vtype in _SIZES:
            self.pos += _SIZES[vtype]
        else:
            raise ValueError(f"unknown metadata value type {vtype} at byte {self.pos}")


_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


def metadata(path: str | Path, keys) -> dict[str, object]:
    """The values of the metadata ``keys`` the GGUF file at ``path`` has, strings and numbers (an
    array's key is left out); every other value is skipped by its length, never read."""
    keys = set(keys)
    with open(path, "rb") as f:
        raw = np.memmap(f, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if cur.take("I") != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    cur.take("I")
    _, n_fields = cur.take("Q"), cur.take("Q")
    out: dict[str, object] = {}
    for _ in range(n_fields):
        key, vtype = cur.string(), cur.take("I")
        if key in keys and vtype == GGUFValueType.STRING:
            out[key] = cur.string()
        elif key in keys and vtype in _SCALARS:
            out[key] = cur.take(_SCALARS[vtype])
        else:
            cur.skip_value(vtype)
    return out


def tensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of the GGUF file at ``path``, by name, its bytes mapped in place."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if cur.take("I") != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}, this reader takes 2 and 3")
    n_tensors, n_fields = cur.take("Q"), cur.take("Q")
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_fields):
        key, vtype = cur.string(), cur.take("I")
        if key == "general.alignment" and vtype in _UNSIGNED:
            alignment = cur.take(_UNSIGNED[vtype])
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append((name, GGMLQuantizationType(cur.take("I")), dims, cur.take("Q")))
    start = -(-cur.pos // alignment) * alignment
    out = {}
    for name, qtype, dims, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims, dtype=np.int64))
        if count % block:
            raise ValueError(f"{path}: tensor {name} has {count} values, not whole {qtype.name} blocks")
        begin = start + offset
        out[name] = Tensor(name, qtype.name, tuple(reversed(dims)), raw[begin : begin + count // block * size])
    return out
