"""The drafter's service core, ``Drafter``: every session of this replica (one ``DraftSession`` per
(tenant, session)), their snapshots, memory bound and tenant corpora.

A session's snapshot goes to the store at every turn end and every ``snapshot_every`` rounds, after
the response is sent; another replica that is handed the session restores the snapshot and replays
the tokens after it, or rebuilds from the history. No grpc: the service converts its messages.

Memory is bounded in bytes (``max_bytes``: each session's estimate taken when it enters memory and
when its stream ends, plus the tenant corpora held): past the bound the least recently used idle
sessions leave memory, their snapshot written first, and their next turn restores from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from common.costs import ContextSlope
from common.errors import Abort, Status
from common.errors import check as _check
from common.logs import Throttled
from common.params import MODES
from common.sessions import Entry as _Entry
from common.sessions import Holder, SessionTable

from . import metrics as M
from .corpora import Corpora, Response
from .draft_session import AUTO, DrafterConfig, DraftSession
from .prefixes import SharedPrefixes
from .snapshot import SnapshotError, dumps, loads
from .tree import DraftTree

log = logging.getLogger("racer.drafter")

MAX_BUDGET = 4096
MAX_FORCED = 64  # forced tokens drafted per step (a tree stays within MAX_BUDGET nodes)
MAX_CORPUS_TOKENS = 1 << 26  # a tenant corpus bound (~3 GB at 45 bytes a token)


@dataclass
class Entry(_Entry):
    session: DraftSession = None  # type: ignore[assignment] - always given
    tree: list[int] = field(default_factory=list)  # last tree sent, for the next step's feedback
    parents: list[int] = field(default_factory=list)
    rounds_since_save: int = 0
    saved_length: int = -1
    writes: int = 0  # snapshot writes scheduled: the last one's number
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one write of the session at a time
    bytes: int = 0  # the session's memory estimate when it last opened or was released
    dropped: bool = False  # closed (``drop``) while a stream still held it: nothing more is saved
    corpus_on: bool = False  # this turn drafts from the tenant corpus
    response: Response | None = None  # this turn's response going into the tenant corpus (None: not shared)
    opened_length: int = 0  # the session's history when this stream opened it
    rest: int = 0  # rounds the gateway may verify without a tree after the last one (the budget rests)

    @property
    def snapshot_key(self) -> str:
        return snapshot_key(self.tenant, self.session_id)


def snapshot_key(tenant: str, session_id: str) -> str:
    return f"racer:drafter:{tenant}:{session_id}"


@dataclass(frozen=True)
class Open:
    """A stream's first message: the session's history and the verifier's top-k at its last positions."""

    tenant: str
    session_id: str
    history: list[int]
    history_topk: list[int]  # [rows * topk] flattened: top-k of the last ``rows`` history positions
    topk: int = 0  # 0: this drafter's
    cost: dict[int, float] | None = None  # the verifier's ms by tree size (adaptive budget)
    slope: ContextSlope | None = None  # what the context adds to ``cost`` (None: not measured)
    overhead_ms: float = 0.0
    plain_overhead_ms: float | None = None  # a round without the drafter (None: the gateway drafts every round)
    share: bool = True  # this turn's response goes into the tenant corpus
    corpus: bool = True  # the tenant drafts from (and adds to) a corpus at all
    corpus_tokens: int = 0  # the tenant's corpus bound (0: this drafter's default)


@dataclass(frozen=True)
class Step:
    """Feedback on the last tree (its nodes' top-k, the accepted path, how much of it is committed)
    and what the next tree is asked to be."""

    tree_topk: list[int]  # [nodes * topk] flattened
    accepted: list[int]
    commit: int
    root: int
    budget: int
    mode: str
    batch_rows: int = 0
    forced: tuple[int, ...] = ()  # tokens that must follow the root: a draft path of their own
    # Tokens of the rounds verified without a tree since the last one (it said rest), after its
    # committed ones, and the target's top-k after each ([len(plain) * topk] flattened).
    plain: tuple[int, ...] = ()
    plain_topk: tuple[int, ...] = ()


@dataclass(frozen=True)
class SessionStats:
    tenant: str
    session_id: str
    tokens: int
    nodes: int
    memory_bytes: int
    streaming: bool


class Drafter(Holder):
    def __init__(
        self,
        config: DrafterConfig,
        store,
        prior=None,
        snapshot_every: int = 32,
        ttl: float = 1800.0,
        max_tokens: int = 65_536,
        max_bytes: int = 0,
        corpora: Corpora | None = None,
        prefixes: SharedPrefixes | None = None,
    ):
        self.config = config
        # shared prompt prefixes (the default: none)
        self.prefixes = prefixes if prefixes is not None else SharedPrefixes(config.window, config.topk, 0)
        self.corpora = corpora or Corpora(0)  # tenant corpora (the default: none)
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes  # sessions in memory, estimated; 0: bounded only by the TTL
        self.store = store
        self.prior = prior
        self.snapshot_every = snapshot_every
        self.sessions: SessionTable[Entry] = SessionTable(ttl)
        self._tasks: set[asyncio.Task] = set()
        self._warnings = Throttled(log)  # snapshot failures: all counted, logged at most every 10 s

    # -- a stream -----------------------------------------------------------------------------
    async def open(self, req: Open) -> tuple[Entry, str]:
        """The session's entry, caught up with ``req.history``, held by the calling stream; and where
        it came from: memory, snapshot or new."""
        rows = self._checked_rows(req)
        history = list(req.history)
        entry = self.sessions.get((req.tenant, req.session_id))
        if entry is not None:
            _check(not entry.streaming, Status.ABORTED, f"session {req.session_id}: another stream is open on it")
        source = "memory"
        if entry is None or not _is_prefix(entry.session.history, history):
            session = await self._restore(req.tenant, req.session_id, history)
            source = "snapshot" if session is not None else "new"
            if session is None:
                session = self._new_session(req.tenant, history, rows)
            entry = self.sessions.put(Entry(req.tenant, req.session_id, session=session))
            entry.saved_length = len(session.history) if source == "snapshot" else -1
        M.RESTORES.labels(source).inc()
        if req.cost:
            try:
                entry.session.set_costs(req.cost, req.overhead_ms, req.plain_overhead_ms, req.slope)
            except ValueError as e:
                raise Abort(Status.INVALID_ARGUMENT, f"open.cost: {e}") from None
        entry.touch()
        entry.tree = []
        entry.rest = 0
        _catch_up(entry.session, history, rows)
        entry.opened_length = len(history)
        await self._open_corpus(entry, req)
        self.sessions.claim(entry)  # only once the open succeeded: a failed one leaves no stream behind
        self._bound(entry, estimate=source != "memory")  # (~5 ms for a full session: not before every turn)
        return entry, source

    def _new_session(self, tenant: str, history: list[int], rows: list[list[int]]) -> DraftSession:
        """A session for ``history``, beginning with the tenant's shared prefix of it if there is one."""
        session = DraftSession(self.config, self.prior)
        if not self.prefixes.enabled:
            return session
        built = self.prefixes.built
        prefix = self.prefixes.for_new_session(tenant, history, rows)
        M.PREFIX_OPENS.labels("none" if prefix is None else "built" if self.prefixes.built > built else "shared").inc()
        if prefix is not None:
            session.attach_prefix(prefix)
        return session

    def _checked_rows(self, req: Open) -> list[list[int]]:
        """Checks an open's fields; the top-k rows of the history's last positions."""
        _check(bool(req.session_id), Status.INVALID_ARGUMENT, "open.session_id: required")
        _check(bool(req.tenant), Status.INVALID_ARGUMENT, "open.tenant: required")
        n = len(req.history)
        _check(n > 0, Status.INVALID_ARGUMENT, "open.history: empty")
        _check(
            n <= self.max_tokens,
            Status.RESOURCE_EXHAUSTED,
            f"open.history: {n} tokens, this drafter holds at most {self.max_tokens} per session",
        )
        _check(all(t >= 0 for t in req.history), Status.INVALID_ARGUMENT, "open.history: negative token id")
        k = self.config.topk
        _check(req.topk in (0, k), Status.INVALID_ARGUMENT, f"open.topk: {req.topk}, this drafter uses {k}")
        _check(
            len(req.history_topk) % k == 0, Status.INVALID_ARGUMENT, f"open.history_topk: not a multiple of topk={k}"
        )
        _check(all(t >= 0 for t in req.history_topk), Status.INVALID_ARGUMENT, "open.history_topk: negative token id")
        n_rows = len(req.history_topk) // k
        _check(n_rows <= n, Status.INVALID_ARGUMENT, "open.history_topk: more rows than history tokens")
        _check(
            0 <= req.corpus_tokens <= MAX_CORPUS_TOKENS,
            Status.INVALID_ARGUMENT,
            f"open.corpus_tokens: {req.corpus_tokens}, expected 0 (the default) .. {MAX_CORPUS_TOKENS}",
        )
        return np.asarray(req.history_topk, dtype=np.int64).reshape(n_rows, k).tolist()

    async def _open_corpus(self, entry: Entry, req: Open) -> None:
        """This turn's use of the tenant corpus: whether it drafts from it, and its response going in."""
        if entry.response is not None:
            self.corpora.finish(entry.response)
        entry.corpus_on = req.corpus and self.corpora.enabled
        entry.response = await self.corpora.open(req.tenant, req.corpus_tokens, req.share) if req.corpus else None
        entry.session.corpus = self.corpora.current(req.tenant) if entry.corpus_on else None

    def step(self, entry: Entry, st: Step) -> DraftTree:
        """Learns from the last tree's feedback and builds the next tree."""
        s = entry.session
        mode = _checked_mode(st, adaptive_ok=s.chooser is not None)  # first: a refused step changes nothing
        if entry.tree:
            self._learn(entry, st, mode)
        else:
            _check(
                not st.tree_topk and not st.accepted and not st.plain,
                Status.INVALID_ARGUMENT,
                "step: feedback for a tree this stream never sent",
            )
        # the corpus as it is now: loaded meanwhile, replaced when erased, gone when dropped
        s.corpus = self.corpora.current(entry.tenant) if entry.corpus_on else None
        tree = s.draft(st.root, st.budget, mode, st.batch_rows)
        # a grammar's forced path is worth a drafted round: no rest then
        entry.rest = s.rest if st.budget == AUTO and not st.forced else 0
        n_corpus = len(tree.corpus_nodes)
        if n_corpus:
            M.DRAFT_NODES.labels("corpus").inc(n_corpus)
        M.DRAFT_NODES.labels("session").inc(len(tree) - 1 - n_corpus)
        if st.forced:
            tree = tree.with_path(st.forced[: max(0, min(MAX_FORCED, MAX_BUDGET - len(tree)))])
        entry.tree = list(tree.tokens)
        entry.parents = list(tree.parents)
        entry.touch()
        return tree

    def _learn(self, entry: Entry, st: Step, mode: str) -> None:
        """Checks the feedback on the last tree sent, learns from it and commits its accepted tokens."""
        s = entry.session
        k = self.config.topk
        n = len(entry.tree)
        _check(
            len(st.tree_topk) == n * k,
            Status.INVALID_ARGUMENT,
            f"step.tree_topk: {len(st.tree_topk)} ids, expected {n} nodes x topk {k}",
        )
        acc = list(st.accepted)
        _check(bool(acc) and acc[0] == 0, Status.INVALID_ARGUMENT, "step.accepted: must start at the root (0)")
        _check(all(0 <= a < n for a in acc), Status.INVALID_ARGUMENT, "step.accepted: index outside the tree")
        parents = entry.parents
        _check(
            all(parents[acc[i + 1]] == acc[i] for i in range(len(acc) - 1)),
            Status.INVALID_ARGUMENT,
            "step.accepted: not a root-to-node path of the last tree",
        )
        _check(1 <= st.commit <= len(acc), Status.INVALID_ARGUMENT, f"step.commit: {st.commit}, accepted {len(acc)}")
        _check(all(t >= 0 for t in st.tree_topk), Status.INVALID_ARGUMENT, "step.tree_topk: negative token id")
        _check(
            len(st.plain_topk) == len(st.plain) * k,
            Status.INVALID_ARGUMENT,
            f"step.plain_topk: {len(st.plain_topk)} ids, expected {len(st.plain)} tokens x topk {k}",
        )
        _check(
            len(st.plain) <= entry.rest,
            Status.INVALID_ARGUMENT,
            f"step.plain: {len(st.plain)} tokens, but the last tree left {entry.rest} rounds of rest",
        )
        _check(
            all(t >= 0 for t in st.plain) and all(t >= 0 for t in st.plain_topk),
            Status.INVALID_ARGUMENT,
            "step.plain: negative token id",
        )
        rows = np.asarray(st.tree_topk, dtype=np.int64).reshape(n, k).tolist()
        committed = [entry.tree[i] for i in acc[: st.commit]]
        # first: a refused step leaves the session as it was
        self._to_corpus(entry, committed + list(st.plain), "step")
        self._count_accepted(s, acc)
        s.observe_tree(entry.tree, rows, acc)
        s.extend(committed)
        if st.plain:
            plain_rows = np.asarray(st.plain_topk, dtype=np.int64).reshape(len(st.plain), k).tolist()
            s.catch_up(st.plain, plain_rows, mode)
        entry.rounds_since_save += 1 + len(st.plain)

    def _to_corpus(self, entry: Entry, tokens: list[int], what: str) -> None:
        """Tokens of this turn's response into the tenant corpus (none: not shared)."""
        if entry.response is None:
            return
        try:
            self.corpora.append(entry.response, tokens)
        except ValueError as e:
            raise Abort(Status.INVALID_ARGUMENT, f"{what}: {e}") from None

    @staticmethod
    def _count_accepted(s: DraftSession, accepted: list[int]) -> None:
        """The last tree's accepted nodes, counted by source in the session and the metrics."""
        before = dict(s.accepted)
        s.count_accepted(accepted)
        for source, count in s.accepted.items():
            if count > before[source]:
                M.DRAFT_ACCEPTED.labels(source).inc(count - before[source])

    def end_turn(self, entry: Entry, tokens=()) -> None:
        """The turn is over: its response goes into the tenant corpus whole (``tokens``: every token
        the session gained since this stream's open; those no step committed, the last round's, are
        added now and published at the next sync), and the session is saved right after. The last
        round's accepted nodes, which no step fed back, are counted from those tokens."""
        entry.rounds_since_save = self.snapshot_every
        tokens = list(tokens)
        committed = entry.session.history[entry.opened_length :]
        consistent = _is_prefix(committed, tokens)
        if consistent and entry.tree:
            self._count_accepted(entry.session, _emitted_path(entry.tree, entry.parents, tokens[len(committed) :]))
        if entry.response is None or not tokens:
            return
        _check(
            consistent,
            Status.INVALID_ARGUMENT,
            f"end_turn.tokens: {len(tokens)} tokens that do not begin with the {len(committed)} committed since open",
        )
        self._to_corpus(entry, tokens[len(committed) :], "end_turn.tokens")
        self.corpora.finish(entry.response)
        entry.response = None  # the response is whole: nothing more of this stream goes in

    def after_response(self, entry: Entry) -> None:
        """Off the round's critical path: the response is on its way before the snapshot is encoded."""
        if entry.rounds_since_save >= self.snapshot_every and not entry.dropped:
            self._save_later(entry)

    def release(self, entry: Entry) -> None:
        """The stream ended: the session stays for the next one, and what changed is saved."""
        self.sessions.release(entry)
        if entry.response is not None:
            self.corpora.finish(entry.response)  # its last tokens go out at the next sync
            entry.response = None
        if entry.dropped or self.sessions.get(entry.key) is not entry:
            return  # closed or evicted meanwhile
        if len(entry.session.history) != entry.saved_length:
            self._save_later(entry)
        self._bound(entry)

    # -- memory -------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Estimated bytes held: the sessions in memory (as of their last open or release) and the
        tenant corpora (as they are now)."""
        return sum(e.bytes for e in self.sessions) + self.corpora.nbytes() + self.prefixes.nbytes()

    def _bound(self, entry: Entry, estimate: bool = True) -> None:
        """Re-estimates ``entry`` (unless told not to); while the sessions and the tenant corpora are
        over ``max_bytes``, the least recently used idle session (never ``entry``) is snapshotted and
        dropped from memory. (Corpora are not evicted for sessions: they leave when their tenant has
        been idle, ``Corpora.expire``; corpora alone over the bound leave only busy sessions.)"""
        if estimate:
            entry.bytes = entry.session.memory_estimate() if self.max_bytes else 0
        sessions = sum(e.bytes for e in self.sessions)
        corpora = self.corpora.nbytes() + self.prefixes.nbytes()
        while self.max_bytes and sessions + corpora > self.max_bytes:
            victim = self.sessions.idle_lru(keep=entry.key)
            if victim is None:
                break
            if len(victim.session.history) != victim.saved_length:
                self._save_later(victim)  # serialized now; the write finishes after it has left memory
            self.sessions.pop(victim.key)
            sessions -= victim.bytes
            M.EVICTIONS.inc()
        M.DRAFTER_BYTES.set(sessions)
        M.CORPUS_BYTES.set(self.corpora.nbytes())
        M.PREFIX_BYTES.set(self.prefixes.nbytes())
        M.PREFIXES.set(len(self.prefixes))
        M.DRAFTER_SESSIONS.set(len(self.sessions))

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
        entry.writes += 1
        task = asyncio.create_task(self._write(entry, entry.writes, data, length, encode_ms))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, entry: Entry, number: int, data: bytes, length: int, encode_ms: float) -> None:
        # In order, one at a time: a write held up (a retry after Redis restarted) must not land
        # after a newer snapshot of the session, and one with a newer behind it is not needed.
        async with entry.write_lock:
            if number == entry.writes:
                await self._write_now(entry, data, length, encode_ms)

    async def _write_now(self, entry: Entry, data: bytes, length: int, encode_ms: float) -> None:
        t0 = time.perf_counter()
        key = entry.snapshot_key
        try:
            await self.store.set(key, data, self.ttl)
        except Exception as e:  # noqa: BLE001 - a lost snapshot costs draft quality, never output
            M.SNAPSHOT_FAILURES.labels("save").inc()
            self._warnings.warning("snapshot save failed", key=key, tokens=length, error=repr(e))
            if entry.saved_length == length:
                entry.saved_length = -1  # not saved: the next trigger (or the shutdown flush) tries again
            return
        if entry.dropped:  # the session was closed while this write was on its way: it stays closed
            try:
                await self.store.delete(key)
            except Exception as e:  # noqa: BLE001 - the snapshot then expires with its TTL
                self._warnings.warning("snapshot delete failed", key=key, error=repr(e))
            return
        M.SNAPSHOT_BYTES.observe(len(data))
        M.SNAPSHOT_SECONDS.labels("save").observe(encode_ms / 1e3 + time.perf_counter() - t0)

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
            session = loads(
                data,
                self.config,
                self.prior,
                max_tokens=self.max_tokens,
                prefix=lambda length, digest: self.prefixes.resolve(tenant, length, digest, history),
            )
        except SnapshotError as e:  # checked with bounded work: discarded, the session is rebuilt from history
            M.SNAPSHOT_FAILURES.labels("restore").inc()
            self._warnings.warning(
                "snapshot unusable; rebuilding from the history", session_id=session_id, error=str(e)[:200]
            )
            return None
        if not _is_prefix(session.history, history):
            log.info("snapshot does not match the history; rebuilding", extra={"session_id": session_id})
            return None
        M.SNAPSHOT_SECONDS.labels("restore").observe(time.perf_counter() - t0)
        return session

    async def flush(self) -> None:
        """Saves every session that changed since its last snapshot and waits for the writes; publishes
        what the tenant corpora still hold back."""
        for entry in self.sessions:
            if entry.response is not None:
                self.corpora.finish(entry.response)
        try:
            await self.corpora.sync()
        except Exception as e:  # noqa: BLE001 - the store is down: those chunks are lost, output is not
            log.warning("corpus sync failed", extra={"error": repr(e)})
        for entry in self.sessions:
            if len(entry.session.history) != entry.saved_length:
                self._save_later(entry)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def expire(self) -> int:
        """Drops sessions idle longer than the TTL (their snapshots expire in the store on their own),
        and the corpora of tenants idle longer than theirs."""
        gone = self.sessions.expire()
        M.DRAFTER_SESSIONS.set(len(self.sessions))
        self.corpora.expire(busy={e.tenant for e in self.sessions if e.streaming})
        return len(gone)

    async def erase_corpus(self, tenant: str) -> bool:
        """Erases the tenant's corpus here, in the store and on every replica (at their next sync):
        no session drafts from what it held or adds to it again (running turns add nothing more)."""
        _check(bool(tenant), Status.INVALID_ARGUMENT, "erase.tenant: required")
        existed = await self.corpora.erase(tenant)
        self.prefixes.drop_tenant(tenant)
        for e in self.sessions:
            if e.tenant == tenant:
                e.session.corpus, e.response = None, None
        return existed

    async def drop(self, tenant: str, session_id: str) -> bool:
        """Forgets a session here and in the store; whether there was one."""
        entry = self.sessions.pop((tenant, session_id))
        if entry is not None:
            entry.dropped = True  # a stream still on it (a turn being ended) saves nothing more
        try:
            in_store = await self.store.delete(snapshot_key(tenant, session_id))
        except Exception as e:  # noqa: BLE001
            log.warning("snapshot delete failed", extra={"session_id": session_id, "error": repr(e)})
            in_store = False
        M.DRAFTER_SESSIONS.set(len(self.sessions))
        return entry is not None or in_store

    def stats(self) -> list[SessionStats]:
        return [
            SessionStats(
                e.tenant,
                e.session_id,
                len(e.session.history),
                len(e.session.automaton),
                e.session.memory_estimate(),
                e.streaming,
            )
            for e in self.sessions
        ]


def _catch_up(s: DraftSession, history: list[int], rows: list[list[int]]) -> None:
    """Extends ``s`` to ``history``; ``rows`` are the target's top-k at the history's last positions
    (those of them ``s`` does not hold yet go into its copy-logit table)."""
    have = len(s.history)
    first_row = len(history) - len(rows)  # position of rows[0]
    plain_end = max(have, first_row)
    s.extend(history[have:plain_end])
    if plain_end < len(history):
        s.extend(history[plain_end:], rows[plain_end - first_row :])


def _checked_mode(st: Step, adaptive_ok: bool) -> str:
    """Checks what the next tree is asked to be; its drafting mode."""
    _check(st.root >= 0, Status.INVALID_ARGUMENT, f"step.root: {st.root}")
    _check(
        0 <= st.budget <= MAX_BUDGET,
        Status.INVALID_ARGUMENT,
        f"step.budget: {st.budget}, expected 0 (adaptive) or 1..{MAX_BUDGET}",
    )
    mode = st.mode or "racer"
    _check(
        st.budget > 0 or adaptive_ok or mode == "off",
        Status.FAILED_PRECONDITION,
        "step.budget: 0 (adaptive) needs a cost curve at open",
    )
    _check(mode in MODES, Status.INVALID_ARGUMENT, f"step.mode: {mode!r}, expected one of {', '.join(MODES)}")
    _check(st.batch_rows >= 0, Status.INVALID_ARGUMENT, f"step.batch_rows: {st.batch_rows}")
    return mode


def _emitted_path(tokens: list[int], parents: list[int], rest: list[int]) -> list[int]:
    """The nodes of a tree (root first) that ``rest`` spells from its root on: the accepted path,
    since the tokens after the root are the accepted nodes' and then the target's own (which no
    child of the last accepted node carries, or the target would have accepted it). Only the root
    when ``rest`` does not begin at the tree's root."""
    if not rest or rest[0] != tokens[0]:
        return [0]
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
    path = [0]
    for tok in rest[1:]:
        node = children.get((path[-1], tok))
        if node is None:
            break
        path.append(node)
    return path


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a
