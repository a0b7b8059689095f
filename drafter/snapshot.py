"""A drafter session as bytes and back: the snapshot another replica restores.

The format is an ``.npz`` archive of flat integer arrays, read with ``allow_pickle=False``: a
snapshot from a store can never run code. ``meta`` holds the format version, the configuration the
state was built with and the token count the snapshot stands for (its version).

A session that begins with a shared prompt prefix (drafter/prefixes.py) is written in format 2: one
more member, ``prefix`` (its length and digest), and only what the session holds of its own: the
automaton and rows after the prefix, and the history after it. The restoring drafter resolves the
prefix (``loads(..., prefix=)``: from memory, or rebuilt from the open's history, which must hash to
the digest); a snapshot whose prefix it cannot resolve is a ``SnapshotError``. A session without
one is written in format 1, as before.

Nothing read from the store is trusted: before anything is decoded, every member's size is bounded
by the header and the drafter's configuration (a small member that inflates to gigabytes is refused
unread), and every array is checked (dtype, shape, ranges, the trie's links: see
``Automaton.from_state``) in time linear in its size. Anything else is a ``SnapshotError``, and the
drafter rebuilds the session from its history instead.
"""

from __future__ import annotations

import io
import zipfile
from itertools import chain

import numpy as np

from .automaton import Automaton
from .draft_session import DrafterConfig, DraftSession
from .prefixes import DIGEST_BYTES, SharedPrefix

FORMAT = 1
FORMAT_PREFIX = 2  # format 1 + the ``prefix`` member
_META = ("format", "window", "max_nodes", "topk", "length", "nodes")
_ARRAYS = (
    "meta",
    "parent",
    "token",
    "freq",
    "fail",
    "start",
    "free",
    "child_ptr",
    "child_ids",
    "bucket_starts",
    "bucket_ptr",
    "bucket_nodes",
    "frontier",
    "a_length",
    "table_tokens",
    "table_rows",
    "last_topk",
    "history",
)
_ARRAYS_PREFIX = (*_ARRAYS, "prefix")
MAX_TOKENS = 1 << 20  # history bound when the caller gives none (the drafter passes its max_tokens)
MAX_TABLE_ROWS = 1 << 19  # copy-logit rows: one per distinct token, so at most the vocabulary
_NPY_HEADER = 1024  # bytes an .npy member may hold beyond its data (numpy writes 128)


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
    prefix = session.prefix
    own = len(prefix) if prefix is not None else 0  # history tokens the shared prefix stands for
    arrays = {
        "meta": _i64(
            [
                FORMAT if prefix is None else FORMAT_PREFIX,
                cfg.window,
                cfg.max_nodes,
                cfg.topk,
                len(session.history),
                len(st["parent"]),
            ]
        ),
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
        "history": _i64(session.history[own:]),
    }
    if prefix is not None:
        arrays["prefix"] = np.concatenate([_i64([len(prefix)]), np.frombuffer(prefix.digest, dtype=np.int64)])
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def snapshot_length(data: bytes) -> int:
    """The token count a snapshot stands for, without restoring it."""
    with _Archive(data) as z:
        return int(z.meta()[4])


class _Archive:
    """The snapshot's zip, read member by member with a byte bound each (checked on the declared size
    before reading, and on what is actually inflated)."""

    def __init__(self, data: bytes):
        try:
            self.zf = zipfile.ZipFile(io.BytesIO(data))
            infos = self.zf.infolist()
        except Exception as e:  # noqa: BLE001 - any decoding failure means "not a snapshot"
            raise SnapshotError(f"not a drafter snapshot: {e}") from None
        self.infos = {i.filename: i for i in infos}
        names = set(self.infos)
        if len(names) != len(infos) or names not in ({f"{k}.npy" for k in a} for a in (_ARRAYS, _ARRAYS_PREFIX)):
            self.zf.close()
            raise SnapshotError("not a drafter snapshot: unexpected archive members")

    def __enter__(self) -> "_Archive":
        return self

    def __exit__(self, *exc) -> None:
        self.zf.close()

    def array(self, name: str, max_items: int, ndim: int = 1) -> np.ndarray:
        info = self.infos[f"{name}.npy"]
        bound = 8 * max_items + _NPY_HEADER
        if info.file_size > bound:
            raise SnapshotError(f"snapshot member {name}: {info.file_size} bytes, at most {bound} expected")
        try:
            with self.zf.open(info) as f:
                raw = f.read(bound + 1)
            if len(raw) > bound:
                raise SnapshotError(f"snapshot member {name}: inflates past {bound} bytes")
            a = np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
        except SnapshotError:
            raise
        except Exception as e:  # noqa: BLE001
            raise SnapshotError(f"snapshot member {name}: {e}") from None
        if a.dtype != np.int64 or a.ndim != ndim or a.size > max_items:
            raise SnapshotError(f"snapshot member {name}: {a.dtype} {a.shape}, expected at most {max_items} int64")
        return a

    def meta(self) -> np.ndarray:
        meta = self.array("meta", len(_META))
        if meta.shape != (len(_META),) or int(meta[0]) not in (FORMAT, FORMAT_PREFIX):
            raise SnapshotError(f"unsupported snapshot format (expected {FORMAT} or {FORMAT_PREFIX})")
        if (int(meta[0]) == FORMAT_PREFIX) != ("prefix.npy" in self.infos):
            raise SnapshotError("snapshot format and members disagree")
        return meta


def _need(cond, what: str) -> None:
    if not cond:
        raise SnapshotError(f"corrupt drafter snapshot: {what}")


def _groups(ptr: np.ndarray, ids: np.ndarray, groups: int, what: str) -> list[list[int]]:
    """Groups of a (pointer, ids) pair, after checking the pointers delimit ``ids`` exactly."""
    _need(ptr.shape == (groups + 1,) and ptr[0] == 0 and ptr[-1] == len(ids), f"{what}: pointer array")
    _need(bool(np.all(np.diff(ptr) >= 0)), f"{what}: pointers decrease")
    p, flat = ptr.tolist(), ids.tolist()
    return [flat[p[i] : p[i + 1]] for i in range(groups)]


def loads(data: bytes, config: DrafterConfig, prior=None, max_tokens: int = MAX_TOKENS, prefix=None) -> DraftSession:
    """Restores a session; its configuration must match ``config`` where it shapes the state, and its
    history must hold at most ``max_tokens`` tokens. ``prefix(length, digest)``: the shared prefix a
    snapshot names (None when it cannot be had). Raises ``SnapshotError`` on anything else."""
    with _Archive(data) as z:
        fmt, window, max_nodes, topk, length, nodes = (int(x) for x in z.meta())
        ref = z.array("prefix", 1 + DIGEST_BYTES // 8) if fmt == FORMAT_PREFIX else None
        if (window, max_nodes, topk) != (config.window, config.max_nodes, config.topk):
            raise SnapshotError(
                f"snapshot built with window={window} max_nodes={max_nodes} topk={topk}, "
                f"drafter runs window={config.window} max_nodes={config.max_nodes} topk={config.topk}"
            )
        _need(1 <= nodes <= max_nodes, f"{nodes} nodes, capacity {max_nodes}")
        _need(0 <= length <= max_tokens, f"{length} tokens, at most {max_tokens}")
        arr = {k: z.array(k, nodes) for k in ("parent", "token", "freq", "fail", "start", "free")}
        _need(all(arr[k].size == nodes for k in ("parent", "token", "freq", "fail", "start")), "node arrays' sizes")
        children = _groups(z.array("child_ptr", nodes + 1), z.array("child_ids", nodes), nodes, "children")
        starts = z.array("bucket_starts", length)
        buckets = _groups(z.array("bucket_ptr", length + 1), z.array("bucket_nodes", nodes), len(starts), "buckets")
        frontier = z.array("frontier", window + 1)
        a_length = z.array("a_length", 1)
        table_tokens = z.array("table_tokens", MAX_TABLE_ROWS)
        table_rows = z.array("table_rows", MAX_TABLE_ROWS * topk, ndim=2)
        last_topk = z.array("last_topk", topk)
        history = z.array("history", length)
    shared = _shared_prefix(ref, length, config, prefix)
    own = len(shared) if shared is not None else 0
    seed = min(config.window - 1, own)  # the prefix's last tokens the session's automaton holds too
    _need(a_length.shape == (1,) and int(a_length[0]) == length - own + seed, "automaton length")
    _need(history.size == length - own and bool(np.all(history >= 0)), "history")
    _need(table_rows.shape == (table_tokens.size, topk), "copy-logit table shape")
    _need(bool(np.all(table_tokens >= 0)) and bool(np.all(table_rows >= -1)), "copy-logit table: negative token")
    _need(np.unique(table_tokens).size == table_tokens.size, "copy-logit table: repeated token")
    _need(last_topk.size in (0, topk) and bool(np.all(last_topk >= 0)), "last top-k")
    hist = history.tolist()
    try:
        a = Automaton.from_state(
            {
                "window": window,
                "max_nodes": max_nodes,
                **{k: v.tolist() for k, v in arr.items()},
                "children": children,
                "buckets": list(zip(starts.tolist(), buckets)),
                "frontier": frontier.tolist(),
                "length": length,
            }
        )
    except ValueError as e:
        raise SnapshotError(f"corrupt drafter snapshot: {e}") from None
    last = hist[-1] if hist else shared.tokens[-1] if shared is not None and length else None
    _need(last is None or a.token[a.frontier[1]] == last, "the match state does not end with the last token")
    s = DraftSession(config, prior)
    s.automaton = a
    rows = s.table.rows
    for t, row in zip(table_tokens.tolist(), table_rows.tolist()):
        rows[t] = tuple(x for x in row if x >= 0)
    s.last_topk = tuple(last_topk.tolist())
    if shared is not None:
        s.attach_prefix(shared, hist)
    else:
        s._index(hist)
    return s


def _shared_prefix(ref, length: int, config: DrafterConfig, resolve) -> SharedPrefix | None:
    """The shared prefix a format-2 snapshot names (None for format 1), resolved by ``resolve``."""
    if ref is None:
        return None
    _need(ref.shape == (1 + DIGEST_BYTES // 8,), "prefix reference")
    n = int(ref[0])
    _need(0 < n < length, f"prefix of {n} tokens in a history of {length}")
    shared = resolve(n, ref[1:].tobytes()) if resolve is not None else None
    if shared is None:
        raise SnapshotError(f"the snapshot's shared prefix ({n} tokens) cannot be resolved here")
    _need(len(shared) == n and shared.automaton.window == config.window, "resolved prefix")
    return shared
