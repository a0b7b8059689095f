"""Taking a drafter snapshot apart and putting it back together, to forge bad ones."""

from __future__ import annotations

import io
import zipfile

import numpy as np


def unpack(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k].copy() for k in z.files}


def pack(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def kids(z: dict) -> list[list[int]]:
    ptr, ids = z["child_ptr"].tolist(), z["child_ids"].tolist()
    return [ids[ptr[i] : ptr[i + 1]] for i in range(len(ptr) - 1)]


def set_kids(z: dict, groups: list[list[int]]) -> None:
    z["child_ptr"] = np.concatenate([[0], np.cumsum([len(g) for g in groups])]).astype(np.int64)
    z["child_ids"] = np.asarray([v for g in groups for v in g], dtype=np.int64)


def with_cycle(data: bytes) -> bytes:
    """The snapshot with one of the root's children listed as its own child: a walk from the root
    that does not stop at nodes already seen never ends."""
    z = unpack(data)
    groups = kids(z)
    v = groups[0][0]
    groups[v].append(v)
    set_kids(z, groups)
    return pack(z)


def zip_bomb(data: bytes, inflated: int = 64 << 20) -> bytes:
    """The snapshot with its history member replaced by ``inflated`` bytes of zeros, deflated to a
    few hundred KiB (numpy would read all of it into memory)."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename != "history.npy":
                dst.writestr(info.filename, src.read(info))
                continue
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                header, {"descr": "<i8", "fortran_order": False, "shape": (inflated // 8,)}
            )
            with dst.open("history.npy", "w", force_zip64=True) as f:
                f.write(header.getvalue())
                chunk = bytes(1 << 20)
                for _ in range(inflated >> 20):
                    f.write(chunk)
    return out.getvalue()
