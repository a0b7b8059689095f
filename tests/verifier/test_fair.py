"""The model thread's turns: deficit round robin over tenants' prompts, chunked prefills interleaved,
and rounds that wait behind prompts for a bounded lead.

Orderings are read from the thread's own events; the thread is held by a job that waits on an
Event, so every job of the scenario is queued before any of them runs.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.support.aio import until
from tests.support.stack import prompt
from verifier import metrics as M
from verifier.batcher import TREES
from verifier.engine import VerifierSession
from verifier.fair import ModelThread
from verifier.sessions import Open, Verifier


class Recorder:
    """The thread's events, as (event, tenant, kind, tag) in order."""

    def __init__(self, thread: ModelThread):
        self.events: list[tuple] = []
        self._lock = threading.Lock()
        thread.hooks.append(self)

    def __call__(self, event, job):
        with self._lock:
            self.events.append((event, job.tenant, job.kind))

    def started(self, kind: str | None = None) -> list[str]:
        with self._lock:
            return [t for e, t, k in self.events if e == "start" and (kind is None or k == kind)]

    def count(self, event: str, tenant: str, kind: str) -> int:
        with self._lock:
            return sum(1 for e in self.events if e == (event, tenant, kind))


def test_deficit_round_robin_serves_a_lone_job_of_one_tenant_between_another_tenants_jobs():
    mt = ModelThread(quantum=10)
    rec = Recorder(mt)
    gate = threading.Event()
    try:
        hold = mt.submit("hold", 1, "hold", gate.wait)
        a = [mt.submit("A", 10, "job", lambda: None) for _ in range(4)]
        b = mt.submit("B", 10, "job", lambda: None)
        big = mt.submit("C", 25, "job", lambda: None)  # costs more than a quantum: waits for credit
        gate.set()
        for f in [hold, *a, b, big]:
            f.result(30)
        # FIFO would run A A A A B C; fair turns give B (and C, after saving up) a place early.
        assert rec.started() == ["hold", "A", "B", "A", "A", "C", "A"]
        assert mt.pending == 0 and not mt.stalled(0.0)
    finally:
        mt.close()


def test_stalled_means_work_waits_and_nothing_finishes():
    mt = ModelThread()
    gate = threading.Event()
    try:
        assert not mt.stalled(0.0)  # idle: never stalled
        f = mt.submit("t", 1, "hold", gate.wait)
        assert mt.stalled(-1.0)  # busy and nothing finished within the bound
        assert not mt.stalled(3600.0)
        gate.set()
        f.result(30)
        assert not mt.stalled(-1.0)
    finally:
        mt.close()


def test_a_tenants_short_prefill_passes_another_tenants_long_chunked_prefills(tiny_llama):
    """Tenant A opens three sessions with long prompts, tenant B one short one: B's prefill runs after
    at most one of A's chunks, and B has its first token while A's prompts are still being prefilled.
    Every prefill still gives the unchunked result."""
    chunk, long_n, short_n = 8, 64, 6

    async def go():
        v = Verifier(tiny_llama, kv_memory_bytes=1 << 24, prefill_chunk=chunk)
        rec = Recorder(v.model_thread)
        gate = threading.Event()
        hold = asyncio.ensure_future(v._run(gate.wait, tenant="hold", kind="hold"))
        a_prompts = [prompt(20 + i, long_n) for i in range(3)]
        a_tasks = []
        for i, p in enumerate(a_prompts):
            e = v.claim(Open("A", f"a{i}", p))
            a_tasks.append(asyncio.ensure_future(v.open(e, p)))
        await until(lambda: rec.count("queued", "A", "prefill") == 3)
        b_prompt = prompt(30, short_n)
        eb = v.claim(Open("B", "b", b_prompt))
        b_task = asyncio.ensure_future(v.open(eb, b_prompt))
        await until(lambda: rec.count("queued", "B", "prefill") == 1)
        gate.set()
        await hold
        b_res = await b_task
        a_done_when_b_done = rec.count("done", "A", "prefill")
        a_res = await asyncio.gather(*a_tasks)
        v.close()
        return rec.started("prefill"), a_done_when_b_done, b_res, a_res, a_prompts, b_prompt

    order, a_done, b_res, a_res, a_prompts, b_prompt = asyncio.run(go())
    assert order.index("B") <= 1, order  # FIFO would put it after A's three queued chunks
    a_chunks = 3 * (long_n // chunk)
    assert order.count("A") == a_chunks
    assert a_done < a_chunks // 2, (a_done, order)
    for p, res in [(b_prompt, b_res), *zip(a_prompts, a_res)]:
        ref = VerifierSession(tiny_llama).prefill(p)
        assert res.next_token == ref.next_token
        assert res.topk == [t for row in ref.topk for t in row]


def _round_after_prompts(lead: int, chunk: int = 8, jobs: int = 6) -> tuple[list[str], list[int]]:
    """A round queued behind ``jobs`` prompt jobs of ``chunk`` tokens (the thread held meanwhile):
    the start order, and the prompt tokens each round waited behind (the metric's observations)."""
    mt = ModelThread(quantum=chunk, lead=lead)
    rec = Recorder(mt)
    gate = threading.Event()
    waited: list[int] = []
    observe = M.ROUND_WAIT_TOKENS.observe
    M.ROUND_WAIT_TOKENS.observe = waited.append
    try:
        running = threading.Event()
        # running when the round comes: its chunk counts toward the round's wait
        hold = mt.submit("A", chunk, "prefill", lambda: running.set() or gate.wait())
        running.wait(30)
        prompts = [mt.submit(t, chunk, "prefill", lambda: None) for t in ("A", "B") * (jobs // 2)]
        tree = mt.submit(TREES, 64, "verify", lambda: None)
        gate.set()
        for f in [hold, *prompts, tree]:
            f.result(30)
        return [k for e, _, k in rec.events if e == "start"], waited
    finally:
        M.ROUND_WAIT_TOKENS.observe = observe
        mt.close()


@pytest.mark.parametrize("lead", [0, 8, 16, 20, 1000])
def test_prompts_run_ahead_of_a_waiting_round_up_to_the_lead_then_it_runs(lead):
    """Prompt jobs queued before a round go first while the round has waited behind fewer than
    ``lead`` tokens of prompt work, the job running when it came included; the round then runs
    next, so it never waits behind more than ``lead`` plus one chunk. ``lead=0``: rounds first."""
    chunk = 8
    order, waited = _round_after_prompts(lead, chunk)
    ahead = order.index("verify") - 1  # prompt jobs started between the holder and the round
    expect = min(6, max(0, -(-lead // chunk) - 1))  # while the wait (holder's chunk + those) < lead
    assert ahead == expect, order
    assert waited == [chunk * (1 + ahead)]
    assert waited[0] <= lead + chunk  # the bound


def test_a_round_waits_for_the_lead_in_tokens_prefilled_not_in_jobs_charged(tiny_llama):
    """Eight 4-token prompts wait behind a held thread with a running stream's tree; 16-token
    chunks take them four to a forward. With a 16-token lead the tree runs after the first batched
    forward (its 16 tokens count, though the job that ran it was charged 4); with a lead past the
    burst's 32 tokens, after both: every prompt of the burst gets its first token before the round."""

    async def go(lead):
        v = Verifier(tiny_llama, backend="llama", kv_memory_bytes=1 << 24, prefill_chunk=16, prefill_lead=lead)
        rec = Recorder(v.model_thread)
        p = prompt(40, 6)
        e = v.claim(Open("A", "a0", p))
        first = (await v.open(e, p)).next_token
        forwards_before: list[int] = []  # prefill forwards done when a round starts

        def on(event, job):
            if (event, job.kind) == ("start", "verify"):
                forwards_before.append(len(v.prefills.sizes))

        v.model_thread.hooks.append(on)
        gate = threading.Event()
        hold = asyncio.ensure_future(v._run(gate.wait, tenant="hold", kind="hold"))
        opens = []
        for i in range(8):
            q = prompt(50 + i, 4)
            opens.append(asyncio.ensure_future(v.open(v.claim(Open("B", f"b{i}", q)), q)))
        await until(lambda: rec.count("queued", "B", "prefill") == 8)
        tree = asyncio.ensure_future(v.verify(e, [first], [-1]))
        await until(lambda: any(k == "verify" for _, _, k in rec.events))
        gate.set()
        await hold
        await asyncio.gather(*opens, tree)
        v.close()
        return forwards_before, v.prefills.sizes[1:]

    forwards, sizes = asyncio.run(go(16))
    assert sizes == [4, 4] and forwards == [1 + 1]  # the first session's own prefill, then one batch
    forwards, sizes = asyncio.run(go(10_000))
    assert sizes == [4, 4] and forwards == [1 + 2]
