"""One turn of one session: the rounds over the turn's streams, stop strings, metrics, the saved record.

A turn is all or nothing for the session record: it is saved when the turn ends, so a cancelled or
failed turn leaves the session as it was before (the client may retry it). Drafter and verifier
reconcile their state with the history at every open, whatever happened before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace

from common.errors import Abort, Status
from common.loop import Rounds, Stats
from common.params import GenerationParams
from common.prefix import group_scope
from common.text import Detokenizer
from common.tracing import TurnSpans

from . import metrics as M
from .links import Feedback, LogProbs, Tree, Verified
from .records import Record
from .requests import TurnRequest
from .stops import StopStrings
from .turn_links import TurnLinks

tracer = trace.get_tracer("racer.gateway")


@dataclass(frozen=True)
class Chunk:
    """Tokens verified in one round (or the first token), and their text."""

    session_id: str
    text: str
    token_ids: list[int]
    logprobs: LogProbs | None = None  # of token_ids, when the request asked for them
    # the first chunk, when the request asked for echo: the turn's input tokens and their log-probabilities
    echo_ids: list[int] | None = None
    echo: LogProbs | None = None


@dataclass(frozen=True)
class Finished:
    """The turn's last message: why it ended, the token counts and how the speculation went."""

    session_id: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int  # this turn's new input
    completion_tokens: int
    session_tokens: int  # the whole history, this turn's output included
    stats: Stats
    prefill_ms: float  # inside the backends, summed
    draft_ms: float
    verify_ms: float
    total_ms: float  # seen by the gateway
    tokens_per_second: float
    cached_tokens: int = 0  # of the history, not prefilled: held by the verifier's session or its prefix cache


class Turn:
    def __init__(self, gw, record: Record, history: list[int], n_turn: int, req: TurnRequest):
        self.gw = gw
        self.record = record
        self.history = history  # the record's history and this turn's input
        self.n_turn = n_turn  # tokens of this turn's input
        self.req = req
        self.stop_ids = set(gw.eos_ids) | set(req.stop_ids)
        self.stops = StopStrings(req.stop)
        self.rounds = Rounds(history, GenerationParams(req.max_new, tuple(self.stop_ids), req.mode, req.budget))
        self.stats = self.rounds.stats
        self.links = TurnLinks(gw, record, req.sampling, self.rounds)
        self.links.logprobs = req.logprobs
        self.links.draft_forced = req.forced
        self.links.adjust = (dict(req.logit_bias), req.presence_penalty, req.frequency_penalty)
        self.links.echo = req.echo and req.logprobs >= 0
        # a stop string is found in the text after the fact: a run would go past it
        self.links.runs = gw.runs and not req.stop
        self.constraint = None  # gateway.grammar.Constraint: the output's grammar state (None: free)
        q = gw.quotas.limits.of(record.tenant)  # the tenant's corpus switch and bound
        self.links.corpus = dict(share=req.share and q.share, corpus=q.share, corpus_tokens=q.corpus_tokens)
        self.links.cache_scope = group_scope(q.prefix_group) if q.prefix_group else ""
        self.lease = None  # leases.Lease: the record is saved only while it holds
        self.saved_tokens: int | None = None  # the saved record's length, once saved
        self.cached = 0  # history tokens the turn's first open did not prefill
        self._generated = M.GENERATED_TOKENS.labels(record.tenant)

    def constrain(self, constraint) -> None:
        """The turn's output follows ``constraint`` (a ``gateway.grammar.Constraint``, or None)."""
        self.constraint = self.links.grammar = constraint

    def stop(self, reason: str, code: Status = Status.UNAVAILABLE, field: str | None = None) -> None:
        """Ends the turn with ``code`` at its next round or failover (a draining gateway: UNAVAILABLE;
        a lost lease: ABORTED, about the field ``session_id``)."""
        self.links.abort = reason
        self.links.abort_code = code
        self.links.abort_field = field

    async def stream(self):
        """``Chunk`` messages, then one ``Finished`` once the record is saved."""
        t0 = time.perf_counter()
        sid = self.record.session_id
        rounds, links = self.rounds, self.links
        detok = Detokenizer(self.gw.tokenizer) if self.gw.tokenizer is not None else None
        emitted: list[int] = []
        t_emit = t0  # when the last chunk left
        finished = False
        spans = TurnSpans(tracer, **{"racer.tenant": self.record.tenant, "racer.session_id": sid})
        try:
            with spans.phase("prefill", **{"racer.history_tokens": len(self.history)}):
                opened = await links.open_verifier()
                self.cached = opened.reused_tokens + opened.prefix_tokens
                await links.open_drafter(opened.topk, opened.topk_width)
            spans.start_rounds()
            out, done = rounds.start(opened.next_token)
            self._advance(out)
            lp = opened.logprobs
            feedback = Feedback()
            sent = False  # the next step is already on its way to the drafter
            while True:
                out, done, text = self._stop_strings(detok, out, done)
                if out:
                    t_emit = self._emit(out, emitted, t0, t_emit)
                    chunk = Chunk(sid, text, out, _cut(lp, len(out)))
                    if len(emitted) == len(out) and self.req.echo:  # the first chunk
                        chunk = self._echo(chunk, opened)
                    yield chunk
                if done:
                    break
                links.check_abort()
                t_round = time.perf_counter()
                tree = await links.draft(feedback, sent)
                res = await links.verify(tree)
                # beyond the verifier's time: a drafted round's drafter hop and two RPCs, a plain round's one RPC
                overhead = self.gw.plain_overhead if links.plain_round else self.gw.round_overhead
                overhead.observe((time.perf_counter() - t_round) * 1e3, res.elapsed_ms)
                out, fed, done = rounds.settle(tree.tokens, res.accepted, res.next_token)
                self._advance(out)  # before the next step: its forced tokens follow these
                lp = res.logprobs
                feedback = Feedback(res.topk, res.accepted, len(fed), res.batch_rows)
                # The next step goes out before this round's bookkeeping and text, which are then done
                # while the drafter works. Not with stop strings: the text may still end the turn, and
                # the drafter would have committed tokens past the cut.
                sent = not done and not self.req.stop and await links.send_step(feedback)
                self._count(tree, res)
                spans.round(len(tree.tokens) - 1, len(res.accepted) - 1, len(out), tree.elapsed_ms, res.elapsed_ms)
                M.ROUND_SECONDS.observe(time.perf_counter() - t_round)
            spans.close_rounds()
            finished = True
            with spans.phase("save"):
                last = await self._finish(emitted, t0)
            yield last
        finally:
            spans.close()
            await links.release(cancel=not finished)

    def _emit(self, out: list[int], emitted: list[int], t0: float, t_emit: float) -> float:
        """``out`` leaves now, after ``emitted`` (the turn began at ``t0``, the last chunk left at
        ``t_emit``): time to first token or per output token, the counts. Returns now."""
        now = time.perf_counter()
        if not emitted:
            M.TTFT_SECONDS.observe(now - t0)
        else:
            per = (now - t_emit) / len(out)
            for _ in out:
                M.TPOT_SECONDS.observe(per)
        emitted.extend(out)
        self.rounds.emitted(out)
        self._generated.inc(len(out))
        return now

    def _echo(self, chunk: Chunk, opened) -> Chunk:
        """The first chunk with the turn's input (and, asked for, their log-probabilities)."""
        ids = self.history[len(self.history) - self.n_turn :]
        lp = opened.echo
        if lp is not None:  # what the verifier prefilled of them (all, unless it held a prefix)
            k = min(len(ids), len(lp.chosen))
            pad = len(ids) - k
            lp = LogProbs(
                [None] * pad + lp.chosen[len(lp.chosen) - k :],
                [[]] * pad + lp.top_ids[len(lp.chosen) - k :],
                [[]] * pad + lp.top[len(lp.chosen) - k :],
            )
        return Chunk(chunk.session_id, chunk.text, chunk.token_ids, chunk.logprobs, ids, lp)

    def _advance(self, out: list[int]) -> None:
        """The grammar follows the emitted tokens (a stop string may cut them, but then the turn ends)."""
        if self.constraint is not None:
            self.constraint.advance(out)

    def _stop_strings(self, detok, out, done):
        """Text of ``out``; cut after the token that completes a stop string (which ends the turn)."""
        if detok is None:
            return out, done, ""
        text = ""
        for i, tok in enumerate(out):
            before = len(detok.text)
            text += detok.push([tok])
            if self.stops and self.stops.find(detok.text, before) >= 0:
                return out[: i + 1], True, text
        return out, done, text

    def _count(self, tree: Tree, res: Verified) -> None:
        mode = self.rounds.mode
        M.NUM_DRAFTS.labels(mode).inc()
        M.NUM_DRAFT_TOKENS.labels(mode).inc(len(tree.tokens) - 1)
        M.NUM_ACCEPTED_TOKENS.labels(mode).inc(len(res.accepted) - 1)
        for pos in range(1, len(res.accepted)):
            M.ACCEPTED_PER_POS.labels(str(pos)).inc()

    async def _finish(self, emitted: list[int], t0: float) -> Finished:
        rec = self.record
        history = self.history + emitted
        await self.links.end_turn(history)  # the drafter's response goes into the corpus whole
        rec.history = history
        rec.turns += 1
        rec.last_used = time.time()
        try:
            await self.gw.records.save(rec, self.lease)
            self.saved_tokens = len(rec.history)
        except Abort as e:
            if e.code is Status.ABORTED:
                raise
            raise Abort(e.code, f"{e.message}; the turn was not saved: retry it", field=e.field) from None
        total = time.perf_counter() - t0
        s = self.stats
        last = emitted[-1] if emitted else None
        stop_hit = last in self.stop_ids or (s.new_tokens < self.req.max_new)
        return Finished(
            rec.session_id,
            "stop" if stop_hit else "length",
            self.n_turn,
            s.new_tokens,
            len(rec.history),
            s,
            self.links.prefill_ms,
            self.links.draft_ms,
            self.links.verify_ms,
            total * 1e3,
            s.new_tokens / total if total else 0.0,
            self.cached,
        )


def _cut(lp: LogProbs | None, n: int) -> LogProbs | None:
    """The first ``n`` tokens' log-probabilities (a round's tokens may be cut by a stop)."""
    return None if lp is None else LogProbs(lp.chosen[:n], lp.top_ids[:n], lp.top[:n])
