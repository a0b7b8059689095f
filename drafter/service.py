"""The drafter service: per-session automaton and copy-logit table behind a gRPC stream.

State is keyed by (tenant, session id). A session's snapshot goes to the store at every turn end
and every ``snapshot_every`` rounds, after the response is sent; another replica that is handed
the session restores the snapshot and replays the tokens after it, or rebuilds from the history.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from . import metrics as M
from common.errors import Abort, Status
from common.errors import check as _check
from common.v1 import drafter_pb2 as pb
from common.v1 import drafter_pb2_grpc as pb_grpc

from .session import DrafterConfig, DraftSession
from common.params import MODES
from .snapshot import SnapshotError, dumps, loads

log = logging.getLogger("racer.drafter")

MAX_BUDGET = 4096


@dataclass
class Entry:
    tenant: str
    session_id: str
    session: DraftSession
    tree: list[int] = field(default_factory=list)  # last tree sent, for the next step's feedback
    parents: list[int] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    rounds_since_save: int = 0
    saved_length: int = -1
    streaming: bool = False  # one stream at a time per session

    @property
    def key(self) -> str:
        return snapshot_key(self.tenant, self.session_id)


def snapshot_key(tenant: str, session_id: str) -> str:
    return f"racer:drafter:{tenant}:{session_id}"


class DrafterService(pb_grpc.DrafterServicer):
    def __init__(self, config: DrafterConfig, store, prior=None, snapshot_every: int = 32, ttl: float = 1800.0,
                 max_tokens: int = 65_536):
        self.config = config
        self.max_tokens = max_tokens
        self.store = store
        self.prior = prior
        self.snapshot_every = snapshot_every
        self.ttl = ttl
        self.sessions: dict[tuple[str, str], Entry] = {}
        self._tasks: set[asyncio.Task] = set()
        self._warned_at = -1e9  # snapshot failures are logged at most every 10 s (all are counted)
        self._unlogged = 0

    # -- the stream ---------------------------------------------------------------------------
    async def Session(self, request_iterator, context):
        entry: Entry | None = None
        try:
            async for req in request_iterator:
                t0 = time.perf_counter()
                kind = req.WhichOneof("kind")
                if kind == "open":
                    _check(entry is None, Status.FAILED_PRECONDITION, "open: this stream already has a session")
                    entry, source = await self._open(req.open)
                    resp = pb.DraftResponse(tokens=len(entry.session.history), restored_from=source)
                elif kind == "step":
                    _check(entry is not None, Status.FAILED_PRECONDITION, "step: open the session first")
                    tree = self._step(entry, req.step)
                    resp = pb.DraftResponse(tree=tree, tokens=len(entry.session.history))
                    M.DRAFT_MS.observe((time.perf_counter() - t0) * 1e3)
                elif kind == "end_turn":
                    _check(entry is not None, Status.FAILED_PRECONDITION, "end_turn: open the session first")
                    entry.rounds_since_save = self.snapshot_every  # saved right after the response
                    resp = pb.DraftResponse(tokens=len(entry.session.history))
                else:
                    raise Abort(Status.INVALID_ARGUMENT, "request: set one of open, step, end_turn")
                resp.elapsed_ms = (time.perf_counter() - t0) * 1e3
                yield resp
                # Off the round's critical path: the response is on its way before the snapshot is encoded.
                if entry is not None and entry.rounds_since_save >= self.snapshot_every:
                    self._save_later(entry)
        finally:
            if entry is not None:
                entry.streaming = False
                entry.last_used = time.monotonic()
                if len(entry.session.history) != entry.saved_length and (entry.tenant, entry.session_id) in self.sessions:
                    self._save_later(entry)

    async def _open(self, req: pb.DrafterOpen) -> tuple[Entry, str]:
        _check(bool(req.session_id), Status.INVALID_ARGUMENT, "open.session_id: required")
        _check(bool(req.tenant), Status.INVALID_ARGUMENT, "open.tenant: required")
        history = list(req.history)
        _check(len(history) > 0, Status.INVALID_ARGUMENT, "open.history: empty")
        _check(len(history) <= self.max_tokens, Status.RESOURCE_EXHAUSTED,
               f"open.history: {len(history)} tokens, this drafter holds at most {self.max_tokens} per session")
        _check(all(t >= 0 for t in history), Status.INVALID_ARGUMENT, "open.history: negative token id")
        k = self.config.topk
        _check(req.topk in (0, k), Status.INVALID_ARGUMENT, f"open.topk: {req.topk}, this drafter uses {k}")
        _check(len(req.history_topk) % k == 0, Status.INVALID_ARGUMENT, f"open.history_topk: not a multiple of topk={k}")
        _check(all(t >= 0 for t in req.history_topk), Status.INVALID_ARGUMENT, "open.history_topk: negative token id")
        n_rows = len(req.history_topk) // k
        _check(n_rows <= len(history), Status.INVALID_ARGUMENT, "open.history_topk: more rows than history tokens")
        key = (req.tenant, req.session_id)
        entry = self.sessions.get(key)
        if entry is not None:
            _check(not entry.streaming, Status.ABORTED, f"session {req.session_id}: another stream is open on it")
        source = "memory"
        if entry is None or not _is_prefix(entry.session.history, history):
            session = await self._restore(req.tenant, req.session_id, history)
            source = "snapshot" if session is not None else "new"
            if session is None:
                session = DraftSession(self.config, self.prior)
            entry = Entry(req.tenant, req.session_id, session)
            entry.saved_length = len(session.history) if source == "snapshot" else -1
            self.sessions[key] = entry
        M.RESTORES.labels(source).inc()
        if req.cost.sizes:
            _check(len(req.cost.sizes) == len(req.cost.ms), Status.INVALID_ARGUMENT, "open.cost: sizes and ms differ in length")
            try:
                entry.session.set_costs(dict(zip(req.cost.sizes, req.cost.ms)), req.overhead_ms)
            except ValueError as e:
                raise Abort(Status.INVALID_ARGUMENT, f"open.cost: {e}") from None
        entry.last_used = time.monotonic()
        entry.tree = []
        s = entry.session
        have = len(s.history)
        rows = np.asarray(req.history_topk, dtype=np.int64).reshape(n_rows, k).tolist()
        first_row = len(history) - n_rows  # position of rows[0]
        plain_end = max(have, first_row)
        s.extend(history[have:plain_end])
        if plain_end < len(history):
            s.extend(history[plain_end:], rows[plain_end - first_row :])
        entry.streaming = True  # only once the open succeeded: a failed one leaves no stream behind
        M.DRAFTER_SESSIONS.set(len(self.sessions))
        return entry, source

    def _step(self, entry: Entry, st: pb.DraftStep) -> pb.DraftTree:
        s = entry.session
        k = self.config.topk
        if entry.tree:
            n = len(entry.tree)
            _check(len(st.tree_topk) == n * k, Status.INVALID_ARGUMENT,
                   f"step.tree_topk: {len(st.tree_topk)} ids, expected {n} nodes x topk {k}")
            acc = list(st.accepted)
            _check(bool(acc) and acc[0] == 0, Status.INVALID_ARGUMENT, "step.accepted: must start at the root (0)")
            _check(all(0 <= a < n for a in acc), Status.INVALID_ARGUMENT, "step.accepted: index outside the tree")
            parents = entry.parents
            _check(all(parents[acc[i + 1]] == acc[i] for i in range(len(acc) - 1)), Status.INVALID_ARGUMENT,
                   "step.accepted: not a root-to-node path of the last tree")
            _check(1 <= st.commit <= len(acc), Status.INVALID_ARGUMENT, f"step.commit: {st.commit}, accepted {len(acc)}")
            _check(all(t >= 0 for t in st.tree_topk), Status.INVALID_ARGUMENT, "step.tree_topk: negative token id")
            rows = np.asarray(st.tree_topk, dtype=np.int64).reshape(n, k).tolist()
            s.observe_tree(entry.tree, rows, acc)
            s.extend([entry.tree[i] for i in acc[: st.commit]])
            entry.rounds_since_save += 1
        else:
            _check(not st.tree_topk and not st.accepted, Status.INVALID_ARGUMENT,
                   "step: feedback for a tree this stream never sent")
        _check(st.root >= 0, Status.INVALID_ARGUMENT, f"step.root: {st.root}")
        _check(0 <= st.budget <= MAX_BUDGET, Status.INVALID_ARGUMENT, f"step.budget: {st.budget}, expected 0 (adaptive) or 1..{MAX_BUDGET}")
        _check(st.budget > 0 or s.chooser is not None or (st.mode or "racer") == "off", Status.FAILED_PRECONDITION,
               "step.budget: 0 (adaptive) needs a cost curve at open")
        mode = st.mode or "racer"
        _check(mode in MODES, Status.INVALID_ARGUMENT, f"step.mode: {mode!r}, expected one of {', '.join(MODES)}")
        _check(st.batch_rows >= 0, Status.INVALID_ARGUMENT, f"step.batch_rows: {st.batch_rows}")
        tree = s.draft(st.root, st.budget, mode, st.batch_rows)
        entry.tree = list(tree.tokens)
        entry.parents = list(tree.parents)
        entry.last_used = time.monotonic()
        return pb.DraftTree(tokens=tree.tokens, parents=tree.parents, retrieval_nodes=tree.n_retrieval)

    # -- snapshots ----------------------------------------------------------------------------
    def _save_later(self, entry: Entry) -> None:
        """Serializes now (consistent with this point of the stream), writes in the background."""
        entry.rounds_since_save = 0
        length = len(entry.session.history)
        if length == entry.saved_length:
            return
        t0 = time.perf_counter()
        data = dumps(entry.session)
        encode_ms = (time.perf_counter() - t0) * 1e3
        entry.saved_length = length
        task = asyncio.create_task(self._write(entry, data, length, encode_ms))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, entry: Entry, data: bytes, length: int, encode_ms: float) -> None:
        t0 = time.perf_counter()
        key = entry.key
        try:
            await self.store.set(key, data, self.ttl)
        except Exception as e:  # noqa: BLE001 - a lost snapshot costs draft quality, never output
            M.SNAPSHOT_FAILURES.labels("save").inc()
            now = time.monotonic()
            if now - self._warned_at >= 10.0:
                log.warning("snapshot save failed", extra={"key": key, "tokens": length, "error": repr(e),
                                                           "failures_not_logged": self._unlogged})
                self._warned_at, self._unlogged = now, 0
            else:
                self._unlogged += 1
            if entry.saved_length == length:
                entry.saved_length = -1  # not saved: the next trigger (or the shutdown flush) tries again
            return
        M.SNAPSHOT_BYTES.observe(len(data))
        M.SNAPSHOT_MS.labels("save").observe(encode_ms + (time.perf_counter() - t0) * 1e3)

    async def _restore(self, tenant: str, session_id: str, history: list[int]) -> DraftSession | None:
        t0 = time.perf_counter()
        try:
            data = await self.store.get(snapshot_key(tenant, session_id))
        except Exception as e:  # noqa: BLE001
            M.SNAPSHOT_FAILURES.labels("restore").inc()
            log.warning("snapshot read failed", extra={"session_id": session_id, "error": repr(e)})
            return None
        if data is None:
            return None
        try:
            session = loads(data, self.config, self.prior)
        except SnapshotError as e:
            M.SNAPSHOT_FAILURES.labels("restore").inc()
            log.warning("snapshot unusable", extra={"session_id": session_id, "error": str(e)})
            return None
        if not _is_prefix(session.history, history):
            log.info("snapshot does not match the history; rebuilding", extra={"session_id": session_id})
            return None
        M.SNAPSHOT_MS.labels("restore").observe((time.perf_counter() - t0) * 1e3)
        return session

    async def flush(self) -> None:
        """Saves every session that changed since its last snapshot and waits for the writes."""
        for entry in list(self.sessions.values()):
            if len(entry.session.history) != entry.saved_length:
                self._save_later(entry)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def expire(self) -> int:
        """Drops sessions idle longer than the TTL (their snapshots expire in the store on their own)."""
        now = time.monotonic()
        gone = [k for k, e in self.sessions.items() if not e.streaming and now - e.last_used > self.ttl]
        for k in gone:
            del self.sessions[k]
        M.DRAFTER_SESSIONS.set(len(self.sessions))
        return len(gone)

    # -- unary calls --------------------------------------------------------------------------
    async def Drop(self, request, context):
        entry = self.sessions.pop((request.tenant, request.session_id), None)
        try:
            in_store = await self.store.delete(snapshot_key(request.tenant, request.session_id))
        except Exception as e:  # noqa: BLE001
            log.warning("snapshot delete failed", extra={"session_id": request.session_id, "error": repr(e)})
            in_store = False
        M.DRAFTER_SESSIONS.set(len(self.sessions))
        return pb.DropResponse(existed=entry is not None or in_store)

    async def Stats(self, request, context):
        return pb.DrafterStatsResponse(
            sessions=[
                pb.DrafterSessionStats(
                    session_id=e.session_id, tenant=e.tenant, tokens=len(e.session.history),
                    nodes=len(e.session.automaton.parent) - len(e.session.automaton._free),
                    memory_bytes=e.session.memory_estimate(), streaming=e.streaming,
                )
                for e in self.sessions.values()
            ]
        )


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


async def janitor(service, every: float = 30.0) -> None:
    while True:
        await asyncio.sleep(every)
        await service.expire()
