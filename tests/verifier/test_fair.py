"""The model thread's fair turns: deficit round robin over tenants, chunked prefills interleaved.

Orderings are read from the thread's own events; the thread is held by a job that waits on an
Event, so every job of the scenario is queued before any of them runs.
"""

from __future__ import annotations

import asyncio
import threading

from tests.support.aio import until
from tests.support.stack import prompt
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


def test_a_batch_of_trees_waits_for_one_chunk_not_for_its_tenants_queued_prefills(tiny_llama):
    """Tenant A streams one session and prefills long prompts in four others (four chunks queued in
    A's flow at any time): A's next tree (and so the batch that carries it, other tenants' trees
    included) runs after at most one of A's chunks, not after all of those queued."""
    chunk, long_n, opens = 8, 32, 4

    async def go():
        v = Verifier(tiny_llama, kv_memory_bytes=1 << 24, prefill_chunk=chunk)
        rec = Recorder(v.model_thread)
        p = prompt(40, 6)
        e = v.claim(Open("A", "a0", p))
        first = (await v.open(e, p)).next_token
        with rec._lock:
            rec.events.clear()  # from here on
        gate = threading.Event()
        hold = asyncio.ensure_future(v._run(gate.wait, tenant="hold", kind="hold"))
        prefills = []
        for i in range(opens):
            long = prompt(41 + i, long_n)
            prefills.append(asyncio.ensure_future(v.open(v.claim(Open("A", f"a{i + 1}", long)), long)))
        await until(lambda: rec.count("queued", "A", "prefill") == opens)
        tree = asyncio.ensure_future(v.verify(e, [first], [-1]))
        await until(lambda: any(k == "verify" for _, _, k in rec.events))
        gate.set()
        await hold
        await asyncio.gather(*prefills, tree)
        v.close()
        with rec._lock:
            return [k for ev, _, k in rec.events if ev == "start" and k in ("prefill", "verify")]

    kinds = asyncio.run(go())
    assert kinds.count("prefill") == opens * long_n // chunk
    assert kinds.index("verify") <= 1, kinds  # in A's own flow it would follow the chunks queued before it
