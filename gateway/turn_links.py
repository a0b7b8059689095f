"""``TurnLinks``: a turn's drafter and verifier streams, reopened elsewhere when one breaks or goes silent.

A stream lost mid-turn is reopened on the next endpoint with the committed tokens (``FAILOVERS``
times per kind and turn at most); when every endpoint of a kind has failed, the turn waits up to
``reconnect`` seconds for one to come back (a restarted pod) before it fails with UNAVAILABLE.

A backend that shuts down ends its streams on purpose (UNAVAILABLE, ``draining``) after the round
in flight: the session moves at its next round (a verifier re-prefills it from the history, a
drafter restores its snapshot), which is no failure and does not count against ``FAILOVERS``.
A session stays on its verifier while that one is up and not draining; a new session (or one whose
verifier is gone) goes where its prompt's prefix is cached, else to the least saturated verifier, as
the verifiers report both to every gateway (``Backends.refresh_loads``, ``_verifiers``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from common.errors import Abort, Status
from common.loop import Rounds

from . import metrics as M
from .backoff import Backoff
from .links import DrafterLink, Feedback, Load, Lost, Opened, Tree, Verified, VerifierLink
from .records import Record

log = logging.getLogger("racer.gateway")

DEFAULT_BUDGET = 16  # when the request asks for the adaptive budget but the verifier has no cost curve
ROUND_OVERHEAD_MS = 1.5  # per drafted round outside the verifier's forward, until this gateway has measured it
PLAIN_OVERHEAD_MS = 0.75  # the same for a round without the drafter (mode "off", or the budget resting)
FORCED = 64  # forced tokens sent with a step, at most (drafter.core.MAX_FORCED)
FAILOVERS = 3  # streams lost mid-turn, per service kind and turn (failed opens are bounded by time)


class RoundOverhead:
    """What a round costs beyond the verifier's own time, in milliseconds: for a drafted round the
    drafter's step, two RPCs and this loop; for a plain one (no tree: mode "off", or the adaptive
    budget resting) one RPC and this loop. The adaptive budget adds the first to each tree's forward
    cost and the second to a round without the drafter (``drafter.adaptive``). An exponential average
    over this gateway's rounds of that ``kind``, starting at ``ms``, so the budget follows the machine
    and its load: the larger the drafted round's overhead, the more its extra accepted tokens are
    worth against a bigger tree's forward, and the less a tree is worth against no drafter at all."""

    WEIGHT = 0.05
    CAP_MS = 100.0  # a stalled round (a failover, a stopped process) counts as this at most

    def __init__(self, ms: float = ROUND_OVERHEAD_MS, kind: str = "drafted"):
        self.ms = ms
        self._gauge = M.ROUND_OVERHEAD_SECONDS.labels(kind)
        self._gauge.set(ms / 1e3)

    def observe(self, round_ms: float, verifier_ms: float) -> None:
        extra = round_ms - verifier_ms
        if math.isfinite(extra):
            self.ms += self.WEIGHT * (min(max(extra, 0.0), self.CAP_MS) - self.ms)
            self._gauge.set(self.ms / 1e3)


class TurnLinks:
    """The streams of one turn: chooses endpoints, opens, fails over, and counts backend time."""

    def __init__(self, gw, record: Record, sampling, rounds: Rounds):
        self.gw = gw  # the gateway: its backends, timeouts and verifier load
        self.record = record
        self.sampling = sampling  # SamplingParams, for the verifier
        self.rounds = rounds  # the committed tokens, root, budget and mode the streams carry
        self.drafter: DrafterLink | None = None
        self.verifier: VerifierLink | None = None
        self.cost = None  # the verifier's cost curve (adaptive budget)
        self.prefill_ms = self.draft_ms = self.verify_ms = 0.0  # inside the backends, summed over the turn
        self.failed: dict[str, set[str]] = {"drafter": set(), "verifier": set()}  # not tried again this turn
        self.full: set[str] = set()  # verifiers that refused the session for lack of room
        self.lost = {"drafter": 0, "verifier": 0}  # streams lost mid-turn
        self.last_error = {"drafter": "", "verifier": ""}
        self.abort: str | None = None  # set by a draining gateway: end the turn with UNAVAILABLE
        self.abort_code = Status.UNAVAILABLE  # ABORTED when the session's lease was lost
        self.abort_field: str | None = None  # the request field the abort is about (Abort.field)
        self.waiting: dict[str, float] = {}  # kind -> when to stop waiting for one to come back
        self.corpus: dict = {}  # the tenant corpus for the drafter's open: share, corpus, corpus_tokens
        self.grammar = None  # gateway.grammar.Constraint: the masks the verifier applies (None: none)
        self.logprobs = -1  # log-probabilities the verifier returns (VerifierOpen.logprobs)
        self.draft_forced = True  # the grammar's forced tokens go to the drafter as a path
        self.adjust: tuple = ({}, 0.0, 0.0)  # logit_bias, presence and frequency penalties
        self.echo = False  # the turn's first open returns the prefilled tokens' log-probabilities
        self.turn_start = len(rounds.committed)  # the turn's output starts here in the committed tokens
        self.cache_scope = ""  # the verifiers' prefix-cache scope: the tenant's sharing group ("": its own)
        # The verifier holding most of the prompt's leading blocks at the last placement, and how many:
        # named to another verifier the session opens on, which may fetch them (PrefixSource)
        self.prefix_holder: tuple[str, int] | None = None
        self.drafter_opened = 0  # the session's tokens the drafter stream was opened with
        # The adaptive budget's rest: rounds left to verify without the drafter, the last tree's
        # feedback held meanwhile, the rest's tokens and top-k rows so far (for the step after it),
        # the root of the round in flight when it has no tree, and whether a step awaits its tree.
        self.rest = 0
        self.held: Feedback | None = None
        self.plain: list[int] = []
        self.plain_topk: list[int] = []
        self.plain_root: int | None = None
        self.in_flight = False
        # Runs (VerifyTree.run): whether rounds without a tree may be asked of the verifier as one run
        # (the turn sets it: no stop strings, no grammar), and whether the verifier's next answer is
        # the run's next round, already on its way.
        self.runs = False
        self.running = False
        # kind -> why the session is leaving its backend (drain, lost, full, unreachable); None: it is not
        self.leaving: dict[str, str | None] = {"drafter": None, "verifier": None}

    def check_abort(self) -> None:
        if self.abort:
            raise Abort(self.abort_code, self.abort, field=self.abort_field)

    async def _candidates(self, kind: str) -> list[str]:
        """Endpoints of ``kind`` to try, best first. When every one has failed this turn, waits with
        backoff (at most ``reconnect`` seconds in all) and tries them all again: a restarted pod, a
        Redis-backed drafter coming back, a DNS change."""
        gw = self.gw
        eps = gw.backends.drafters if kind == "drafter" else gw.backends.verifiers
        backoff = None
        while True:
            self.check_abort()
            await eps.refresh()
            if kind == "drafter":
                ranked = eps.ranked(self.record.session_id, exclude=self.failed[kind])
            else:
                ranked = await self._verifiers([e for e in eps.live() if e not in self.failed[kind] | self.full])
            if ranked:
                return ranked
            if kind == "verifier" and self.full and not self.failed[kind]:
                raise Abort(Status.RESOURCE_EXHAUSTED, f"every verifier is full: {self.last_error[kind]}")
            backoff = backoff or Backoff(self._wait_until(kind))
            if backoff.over():
                raise Abort(
                    Status.UNAVAILABLE,
                    f"no {kind} reachable for {gw.timeouts.reconnect:g} s "
                    f"(last error: {self.last_error[kind]}); the turn was not saved: retry it",
                )
            await backoff.sleep()
            self.failed[kind].clear()
            await eps.refresh(force=True)

    def _wait_until(self, kind: str) -> float:
        """When to stop waiting for an endpoint of ``kind``: kept until an open succeeds, so that
        the retries of later opens do not restart the clock."""
        if kind not in self.waiting:
            self.waiting[kind] = time.monotonic() + self.gw.timeouts.reconnect
            log.warning(
                f"no {kind} reachable; waiting for one",
                extra={"session_id": self.record.session_id, "seconds": self.gw.timeouts.reconnect},
            )
        return self.waiting[kind]

    async def _verifiers(self, live: list[str]) -> list[str]:
        """The session's own verifier while it is up and not draining; else every live verifier,
        best first, by what each reports to every gateway (its load, counting every gateway's
        sessions, and the blocks its prefix cache holds):

            score = 2 * overlap - saturation    (saturation in steps of 0.1; ties: fewer streams)

        ``overlap``: the share of the prompt's full blocks (in the session's scope) that the
        verifier holds as a prefix, 0 to 1. A verifier with saturation >= 1 ranks after every one
        below it whatever it holds; among those below, one holding the whole prompt beats any that
        holds nothing (2 > 1), and a partial overlap is weighed against load. That is NVIDIA
        Dynamo's KV router (2 x overlap - usage - queue; our saturation already combines KV usage
        and queues, ``verifier/load.py``) with SGLang's rule that a worker past its load threshold
        is not chosen for its cache. llm-d's precise prefix scorer adds the same two scores with
        configurable weights. The trade-off: a tenant's sessions pile onto the verifier holding
        its prefix until it saturates (a prefill there costs a copy, elsewhere seconds), then
        spill to the next, which caches the prefix too. What a verifier holds comes from its own
        reports, so every gateway places alike; a restarted verifier reports an empty cache (and a
        new epoch), and a silent one is taken to hold nothing."""
        backends = self.gw.backends
        sticky = self.record.verifier
        if sticky in live and not backends.loads.get(sticky, Load()).draining:
            return [sticky]
        if sticky and backends.loads.get(sticky, Load()).draining:
            self.leaving["verifier"] = "drain"  # its Stats say it drains: the session moves, handed over
        loads = await backends.refresh_loads(backends.verifiers.live())
        scope = self.cache_scope or self.record.tenant
        tokens, keys = self.rounds.committed, {}
        overlap = {e: (loads.get(e) or Load()).overlap(scope, tokens, keys) for e in live}

        def key(e: str):
            load = loads.get(e) or Load()  # not asked yet (it just appeared): nothing on it
            saturated, streams = load.rank()
            return (
                load.silent,
                load.draining,
                saturated >= 1,
                saturated - 2 * overlap[e],
                streams,
                backends.verifier_load.get(e, 0),
            )

        ranked = sorted(live, key=key)
        if ranked:
            M.PLACEMENTS.labels("prefix" if overlap[ranked[0]] > 0 else "load").inc()
        # A draining holder still serves its blocks; a silent one is taken to hold nothing.
        named = [e for e in backends.verifiers.live() if e not in self.failed["verifier"]]  # full ones too
        held = {e: (loads.get(e) or Load()).held(scope, tokens, keys) for e in named}
        best = max(held, key=held.get, default=None)
        self.prefix_holder = (best, held[best]) if best is not None and held[best] > 0 else None
        return ranked

    async def open_verifier(self) -> Opened:
        """A verifier stream holding the committed tokens; its next token is the root again (greedy)."""
        gw, rec = self.gw, self.record
        while True:
            ep = (await self._candidates("verifier"))[0]
            link = gw.backends.verifier(ep)
            try:
                left = max(0, self.rounds.max_new - self.rounds.stats.new_tokens)  # KV rows to reserve
                mask = self.grammar.open_mask() if self.grammar is not None else b""
                opened = await link.open(
                    rec.session_id,
                    rec.tenant,
                    self.rounds.committed,
                    self.sampling,
                    left,
                    mask,
                    self.logprobs,
                    self.adjust,
                    self.echo and not self.rounds.stats.rounds,  # the turn's first open only
                    len(self.rounds.committed) - self.turn_start,
                    cache_scope=self.cache_scope,
                    prompt_topk=0 if self.rounds.mode == "off" else None,  # nothing drafted: no table rows
                    stop_ids=sorted(self.rounds.stop),
                    prefix_source=self._prefix_source(ep),
                )
            except (Lost, Abort) as e:
                await link.close(cancel=True)
                if isinstance(e, Abort) and e.code == Status.RESOURCE_EXHAUSTED:
                    self.full.add(ep)  # that verifier has no room: another may
                    self.last_error["verifier"] = f"{ep}: {e.message}"
                    if ep == rec.verifier:
                        self.leaving["verifier"] = "full"
                    continue
                if isinstance(e, Abort):
                    raise
                if ep == rec.verifier:
                    self.leaving["verifier"] = "drain" if e.draining else "unreachable"
                self._unreachable("verifier", e)
                continue
            self.verifier = link
            self.running = False
            self.waiting.pop("verifier", None)
            if rec.verifier != ep:
                gw.backends.placed(ep)
            if rec.verifier and rec.verifier != ep:
                self._moved_verifier(ep, opened)
            self.leaving["verifier"] = None
            rec.verifier = ep
            if opened.cost is not None:
                self.cost = opened.cost
            gw.backends.opened(ep)
            self.prefill_ms += opened.elapsed_ms
            return opened

    def _prefix_source(self, ep: str) -> tuple[str, int, str] | None:
        """The verifier to name as the holder of the prompt's blocks to ``ep``: a session leaving a
        draining verifier names that one, with its id (a hand-over: it holds the session's whole
        history); else the best holder at the last placement, unless that is ``ep`` itself (or none
        holds any)."""
        rec = self.record
        if self.leaving["verifier"] == "drain" and rec.verifier and rec.verifier != ep:
            tokens = len(self.rounds.committed)
            block = (self.gw.backends.loads.get(rec.verifier) or Load()).block_tokens
            return rec.verifier, tokens // block if block else tokens, rec.session_id
        holder = self.prefix_holder
        return (*holder, "") if holder is not None and holder[0] != ep else None

    def _moved_verifier(self, ep: str, opened: Opened) -> None:
        """The session left its record's verifier for ``ep``: counted, with the tokens prefilled again, and logged."""
        rec = self.record
        reason = self.leaving["verifier"] or "gone"  # gone: not among the verifiers when the turn began
        reprefilled = len(self.rounds.committed) - opened.reused_tokens - opened.prefix_tokens
        M.SESSIONS_MOVED.labels("verifier", reason).inc()
        M.REPREFILLED_TOKENS.inc(reprefilled)
        log.info(
            "session moved to another verifier",
            extra={
                "session_id": rec.session_id,
                "from": rec.verifier,
                "to": ep,
                "reason": reason,
                "reprefilled_tokens": reprefilled,
            },
        )

    async def open_drafter(self, topk: list[int], topk_width: int) -> None:
        """A drafter stream holding the committed tokens (``topk``: the verifier's rows for them, if any)."""
        rounds, rec = self.rounds, self.record
        adaptive = rounds.budget == 0 and self.cost is not None
        while True:
            ep = (await self._candidates("drafter"))[0]
            link = self.gw.backends.drafter(ep)
            try:
                restored_from, elapsed_ms = await link.open(
                    rec.session_id,
                    rec.tenant,
                    rounds.committed,
                    topk,
                    topk_width,
                    self.cost if adaptive else None,
                    self.gw.round_overhead.ms,
                    plain_overhead_ms=self.gw.plain_overhead.ms if adaptive else None,
                    **self.corpus,
                )
            except (Lost, Abort) as e:
                await link.close(cancel=True)
                if isinstance(e, Abort):
                    raise
                self._unreachable("drafter", e)
                continue
            self.drafter = link
            self.drafter_opened = len(rounds.committed)
            self.rest, self.held, self.plain, self.plain_topk = 0, None, [], []
            self.plain_root, self.in_flight = None, False
            self.waiting.pop("drafter", None)
            if self.leaving["drafter"] is not None:
                M.SESSIONS_MOVED.labels("drafter", self.leaving["drafter"]).inc()
                self.leaving["drafter"] = None
            self.draft_ms += elapsed_ms
            if rounds.budget == 0 and not adaptive:
                rounds.budget = DEFAULT_BUDGET
            log.debug(
                "drafter open", extra={"session_id": rec.session_id, "drafter": ep, "restored_from": restored_from}
            )
            return

    def _unreachable(self, kind: str, e: Lost) -> None:
        """An open failed: try the next endpoint (``_candidates`` bounds the retries by time)."""
        log.warning(
            f"{kind} unreachable",
            extra={"session_id": self.record.session_id, "endpoint": e.endpoint, "error": e.error},
        )
        self._exclude(kind, e)

    def _exclude(self, kind: str, e: Lost) -> None:
        """Not tried again this turn; every turn skips it for a while (``Endpoints.mark_down``)."""
        self.failed[kind].add(e.endpoint)
        self.last_error[kind] = f"{e.endpoint}: {e.error}"
        (self.gw.backends.drafters if kind == "drafter" else self.gw.backends.verifiers).mark_down(e.endpoint)

    def _lost(self, kind: str, e: Lost) -> None:
        """A stream broke mid-turn: fail over (a few times per turn at most). One its backend ended
        because it is draining moves the session, with no limit (each drain excludes one backend)."""
        self.check_abort()
        self._exclude(kind, e)
        self.leaving[kind] = "drain" if e.draining else "lost"
        if e.draining:
            log.info(
                f"{kind} draining; moving the session",
                extra={"session_id": self.record.session_id, "endpoint": e.endpoint},
            )
            return
        log.warning(
            f"{kind} lost; failing over",
            extra={"session_id": self.record.session_id, "endpoint": e.endpoint, "error": e.error},
        )
        M.FAILOVERS.labels(kind).inc()
        self.lost[kind] += 1
        if self.lost[kind] > FAILOVERS:
            raise Abort(
                Status.UNAVAILABLE,
                f"{kind}s keep failing ({self.lost[kind]} streams lost this turn; "
                f"last: {e.error}); the turn was not saved: retry it",
            )

    async def release(self, cancel: bool) -> None:
        for link in (self.drafter, self.verifier):
            if link is not None:  # a run's rounds the turn no longer wants end with the call
                await link.close(cancel=cancel or (link is self.verifier and self.running))
        if self.verifier is not None:
            self.gw.backends.closed(self.verifier.endpoint)
        self.drafter = self.verifier = None

    def _forced(self) -> list[int]:
        """The tokens the grammar forces after the root (none without drafts: mode "off")."""
        if self.grammar is None or self.rounds.mode == "off" or not self.draft_forced:
            return []
        return self.grammar.forced(FORCED)

    @property
    def plain_round(self) -> bool:
        """The round in flight has no tree: mode "off", or the adaptive budget resting."""
        return self.rounds.mode == "off" or self.plain_root is not None

    def _absorb(self, feedback: Feedback) -> Feedback | None:
        """Takes in the last round's feedback, once per round: what the next step carries, or None
        while the budget rests (the last tree's feedback is held, a plain round's token kept)."""
        if self.plain_root is not None:  # a round without a tree: its token (unless cut) and top-k row
            if feedback.commit:
                self.plain.append(self.plain_root)
                self.plain_topk.extend(feedback.topk)
            self.plain_root = None
            feedback = replace(self.held, batch_rows=feedback.batch_rows)
        if self.rest > 0 and not self._forced():  # a grammar's forced path is drafted, free: no rest then
            self.held = feedback
            return None
        if self.plain:
            feedback = replace(feedback, plain=self.plain, plain_topk=self.plain_topk)
            self.plain, self.plain_topk = [], []
        self.held = None
        return feedback

    async def _send(self, feedback: Feedback) -> None:
        rounds = self.rounds
        await self.drafter.send_step(rounds.root, rounds.budget, rounds.mode, feedback, self._forced())
        self.in_flight = True

    async def send_step(self, feedback: Feedback) -> bool:
        """Takes in the last round's feedback and sends the next step now (unless the budget rests),
        for ``draft(sent=True)`` to read its tree; False: no drafter to send to."""
        if self.drafter is None or self.rounds.mode == "off":
            return False
        step = self._absorb(feedback)
        if step is not None:
            await self._send(step)
        return True

    async def draft(self, feedback: Feedback, sent: bool = False) -> Tree:
        """The next tree at the root; ``sent``: ``send_step`` took this feedback in (only its tree is
        read). Mode "off" drafts nothing: the root alone, without the drafter's two hops. Its session
        learns the turn's tokens at ``end_turn`` (the corpus) and at its next open (the history).
        While the adaptive budget rests (no tree was worth the drafter's hop), a round is the root
        alone too, and the step after the rest carries its tokens."""
        rounds = self.rounds
        if rounds.mode == "off":
            return Tree([rounds.root], [-1], 0.0)
        while True:
            if self.drafter is None:
                await self.open_drafter([], 0)
                feedback = Feedback(batch_rows=feedback.batch_rows)  # a fresh stream has no tree to learn from
                sent = False
            try:
                if not sent:
                    step = self._absorb(feedback)
                    if step is not None:
                        await self._send(step)
                sent = True
                if not self.in_flight:  # the budget rests: this round goes to the verifier alone
                    self.rest -= 1
                    self.plain_root = rounds.root
                    return Tree([rounds.root], [-1], 0.0)
                self.in_flight = False
                tree = await self.drafter.receive_tree()
                self.rest = tree.rest
            except Lost as e:
                await self.drafter.close(cancel=True)
                self.drafter = None
                self._lost("drafter", e)
                continue
            except Abort as e:  # the request was checked at the door: a refused step is our bug, not the caller's
                raise Abort(
                    Status.INTERNAL, f"drafter {self.drafter.endpoint} refused a step: {e.code.name}: {e.message}"
                ) from None
            self.draft_ms += tree.elapsed_ms
            if not rounds.check_tree(tree.tokens):
                raise Abort(Status.INTERNAL, f"drafter {self.drafter.endpoint} returned a tree with the wrong root")
            return tree

    def _run(self, tree: Tree) -> int:
        """Rounds to ask of the verifier as one run, starting with the one in flight (the root alone):
        in mode "off" every round the turn has room for; else this one and the adaptive budget's
        rest after it (the drafter's root alone that starts a rest, or a round of the rest). 0 or 1 (a
        request per round) with a tree, a grammar (its masks follow each token) or stop strings."""
        if not self.runs or self.grammar is not None or len(tree.tokens) != 1:
            return 0
        room = self.rounds.max_new - self.rounds.stats.new_tokens
        return room if self.rounds.mode == "off" else min(room, self.rest + 1)

    async def verify(self, tree: Tree) -> Verified:
        # each node's mask from its own path's grammar state
        masks = self.grammar.tree_masks(tree.tokens, tree.parents) if self.grammar is not None else b""
        while True:
            if self.verifier is None:
                await self.open_verifier()  # its next token is the root again (greedy) or a discarded draw
            try:
                if self.running:  # the verifier went on by itself: this round's answer is on its way
                    res = await self.verifier.more()
                else:
                    res = await self.verifier.verify(tree.tokens, tree.parents, masks, self._run(tree))
                self.running = res.more
            except Abort as e:
                raise Abort(
                    Status.INTERNAL,
                    f"verifier {self.verifier.endpoint} refused a draft tree: {e.code.name}: {e.message}",
                ) from None
            except Lost as e:
                await self.verifier.close(cancel=True)
                self.gw.backends.closed(self.verifier.endpoint)
                self.verifier = None
                self._lost("verifier", e)
                continue
            self.verify_ms += res.elapsed_ms
            return res

    async def end_turn(self, session_tokens: list[int]) -> None:
        """Tells the drafter the turn is over, with ``session_tokens`` (the whole history, this turn's
        output included) past what its stream opened with: the tokens its steps never committed go
        into the tenant corpus, and it may snapshot the session. A failure only logs."""
        try:
            await self.drafter.end_turn(session_tokens[self.drafter_opened :])
        except (Lost, Abort) as e:  # the snapshot and the corpus are optimisations; the turn is done
            log.warning(
                "end_turn failed", extra={"session_id": self.record.session_id, "error": getattr(e, "error", repr(e))}
            )
