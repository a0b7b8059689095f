"""A drafter session as bytes and back: the snapshot another replica restores.

The format is an ``.npz`` archive of flat integer arrays, read with ``allow_pickle=False``: a
snapshot from a store can never run code. ``meta`` holds the format version, the configuration the
state was built with and the token count the snapshot stands for (its version).
"""

from __future__ import annotations

import io
from itertools import chain

import numpy as np

from .automaton import Automaton
from .session import DrafterConfig, DraftSession

FORMAT = 1
_META = ("format", "window", "max_nodes", "topk", "length", "nodes")


class SnapshotError(ValueError):
    """The bytes are not a snapshot this code can restore."""


def _i64(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64).reshape(-1)


def _csr(groups: list) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, groups), dtype=np.int64, count=len(groups)), out=ptr[1:])
    return ptr, np.fromiter(chain.from_iterable(groups), dtype=np.int64, count=int(ptr[-1]))


def dumps(session: DraftSession) -> bytes:
    st = session.automaton.to_state()
    cfg = session.config
    child_ptr, child_ids = _csr(st["children"])
    bucket_starts = [start for start, _ in st["buckets"]]
    bucket_ptr, bucket_nodes = _csr([members for _, members in st["buckets"]])
    rows = session.table.rows
    width = cfg.topk
    table = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows.values()):
        table[i, : len(row)] = row
    arrays = {
        "meta": _i64([FORMAT, cfg.window, cfg.max_nodes, cfg.topk, len(session.history), len(st["parent"])]),
        "parent": _i64(st["parent"]),
        "token": _i64(st["token"]),
        "freq": _i64(st["freq"]),
        "fail": _i64(st["fail"]),
        "start": _i64(st["start"]),
        "free": _i64(st["free"]),
        "child_ptr": child_ptr,
        "child_ids": child_ids,
        "bucket_starts": _i64(bucket_starts),
        "bucket_ptr": bucket_ptr,
        "bucket_nodes": bucket_nodes,
        "frontier": _i64(st["frontier"]),
        "a_length": _i64([st["length"]]),
        "table_tokens": _i64(list(rows.keys())),
        "table_rows": table,
        "last_topk": _i64(session.last_topk),
        "history": _i64(session.history),
    }
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def snapshot_length(data: bytes) -> int:
    """The token count a snapshot stands for, without restoring it."""
    return int(_load(data)["meta"][4])


def _load(data: bytes) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # noqa: BLE001 - any decoding failure means "not a snapshot"
        raise SnapshotError(f"not a drafter snapshot: {e}") from None
    meta = arrays.get("meta")
    if meta is None or meta.shape != (len(_META),) or int(meta[0]) != FORMAT:
        raise SnapshotError(f"unsupported snapshot format (expected {FORMAT})")
    return arrays


def loads(data: bytes, config: DrafterConfig, prior=None) -> DraftSession:
    """Restores a session; its configuration must match ``config`` where it shapes the state."""
    z = _load(data)
    _, window, max_nodes, topk, length, nodes = (int(x) for x in z["meta"])
    if (window, max_nodes, topk) != (config.window, config.max_nodes, config.topk):
        raise SnapshotError(
            f"snapshot built with window={window} max_nodes={max_nodes} topk={topk}, "
            f"drafter runs window={config.window} max_nodes={config.max_nodes} topk={config.topk}"
        )
    try:
        ptr, ids = z["child_ptr"].tolist(), z["child_ids"].tolist()
        bptr, bnodes = z["bucket_ptr"].tolist(), z["bucket_nodes"].tolist()
        a = Automaton.from_state(
            {
                "window": window,
                "max_nodes": max_nodes,
                "parent": z["parent"].tolist(),
                "token": z["token"].tolist(),
                "freq": z["freq"].tolist(),
                "fail": z["fail"].tolist(),
                "start": z["start"].tolist(),
                "free": z["free"].tolist(),
                "children": [ids[ptr[i] : ptr[i + 1]] for i in range(nodes)],
                "buckets": [(s_, bnodes[bptr[i] : bptr[i + 1]]) for i, s_ in enumerate(z["bucket_starts"].tolist())],
                "frontier": z["frontier"].tolist(),
                "length": int(z["a_length"][0]),
            }
        )
        if not (len(a.parent) == len(a.token) == len(a.freq) == len(a.fail) == len(a.start) == nodes):
            raise SnapshotError("snapshot arrays disagree on the node count")
        s = DraftSession(config, prior)
        s.automaton = a
        rows = s.table.rows
        for t, row in zip(z["table_tokens"].tolist(), z["table_rows"].tolist()):
            rows[t] = tuple(x for x in row if x >= 0)
        s.last_topk = tuple(z["last_topk"].tolist())
        s._index(z["history"].tolist())
    except SnapshotError:
        raise
    except (IndexError, KeyError, ValueError, TypeError) as e:
        raise SnapshotError(f"corrupt drafter snapshot: {e}") from None
    if len(s.history) != length:
        raise SnapshotError("snapshot history disagrees with its version")
    return s
