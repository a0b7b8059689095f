"""The model thread: one worker that runs every forward, prompts ahead of rounds for a bounded while.

Two kinds of work share it: prompts (prefill chunks, and cache resizes), which queue per tenant, and
rounds (batches of trees, ``kind == "verify"``), which carry every tenant's trees and queue in one
FIFO of their own.

- Prompts go first, within a bound. A new prompt's first token waits for its prefill, a running
  stream's next tokens for its round: in a burst, letting the prompts go ahead gives every stream
  its first token sooner, and batched prefill (``PrefillBatcher``) takes them many to a forward. But
  a round waits behind at most ``lead`` tokens of prompt work done since it was queued (plus the
  forward running when it came, at most one prefill chunk): once its wait reaches ``lead``, it runs
  next. ``lead=0``: rounds always go first.
- Prompts of different tenants are served by deficit round robin (Shreedhar & Varghese): each
  visit to a tenant adds ``quantum`` tokens to its deficit, and its jobs run while their cost fits
  in it. A tenant with many long prefills thus gets one chunk's worth of model time per turn, like
  every other tenant with work, and another tenant's short prefill waits at most one such turn of
  each busy tenant, not for all of their queued work. Within a tenant jobs run in order, so one
  session's jobs never pass each other.

The thread also says whether it is stuck: ``stalled(bound)`` is true when work has been waiting or
running for ``bound`` seconds without any job finishing (a wedged forward, a dead device).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from . import metrics as M

ROUND = "verify"  # the kind of a job that is a round (a batch of trees): it queues with the rounds


@dataclass
class Job:
    tenant: str
    cost: int  # tokens (a prefill chunk) or rows (a tree batch): what the deficit is charged
    kind: str  # "prefill", "verify" (ROUND), "resize": for scheduling, events and tests
    fn: Callable
    args: tuple
    future: Future = field(default_factory=Future)
    work: int | None = None  # tokens the forward really computed, when not ``cost`` (see ``worked``)
    mark: int = 0  # a round's: the prompt work done (``ModelThread._work``) when it was queued


# A hook sees (event, job) with event "queued" (on the submitting thread), "start" or "done" (on
# the model thread). Tests use them to order jobs and to hold the thread; keep them quick.
Hook = Callable[[str, Job], None]


class ModelThread:
    def __init__(self, quantum: int = 512, threads: int | None = None, name: str = "verifier-model", lead: int = 0):
        self.quantum = max(1, quantum)
        self.lead = max(0, lead)  # prompt tokens that may run ahead of a waiting round
        self.hooks: list[Hook] = []
        self._cv = threading.Condition()
        self._flows: dict[str, deque[Job]] = {}  # tenant -> its queued prompt jobs, in order
        self._ring: deque[str] = deque()  # tenants with queued prompt jobs, in visiting order
        self._deficit: dict[str, int] = {}
        self._granted = False  # whether the tenant at the ring's head got its quantum this turn
        self._rounds: deque[Job] = deque()  # queued rounds, oldest first
        self._work = 0  # tokens of prompt work done so far (a round's wait is the growth since its mark)
        self._running: Job | None = None
        self._closed = False
        self._busy_since = time.monotonic()  # when pending work last went from none to some
        self._last_done = time.monotonic()
        self._threads = threads
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, tenant: str, cost: int, kind: str, fn: Callable, *args) -> Future:
        job = Job(tenant, max(1, cost), kind, fn, args)
        with self._cv:
            if self._closed:
                raise RuntimeError("the model thread has stopped")
            if self._idle():
                self._busy_since = time.monotonic()
            if kind == ROUND:
                job.mark = self._work
                self._rounds.append(job)
            else:
                flow = self._flows.get(tenant)
                if flow is None:
                    flow = self._flows[tenant] = deque()
                    self._ring.append(tenant)
                    self._deficit[tenant] = 0
                flow.append(job)
            M.MODEL_QUEUE.set(self._queued())
            self._cv.notify()
        self._emit("queued", job)
        return job.future

    def worked(self, tokens: int) -> None:
        """Called by the running job: the forward computed ``tokens`` tokens, not its ``cost`` (a
        prefill that took other sessions' waiting prompts along, or one taken along by another).
        What a round waits behind is counted in these."""
        job = self._running
        if job is not None and threading.current_thread() is self._thread:
            job.work = tokens

    def _idle(self) -> bool:
        return self._running is None and not self._ring and not self._rounds

    def _queued(self) -> int:
        return sum(len(f) for f in self._flows.values()) + len(self._rounds)

    @property
    def queued(self) -> int:
        """Jobs waiting for the model thread (``racer_verifier_model_queue``)."""
        with self._cv:
            return self._queued()

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cv:
            return self._queued() + (self._running is not None)

    @property
    def last_done(self) -> float:
        """When a job last finished (``time.monotonic``): it changes whenever the model did work."""
        return self._last_done

    def stalled(self, bound: float) -> bool:
        """Work has waited or run for ``bound`` seconds and no job finished meanwhile."""
        with self._cv:
            if self._idle():
                return False
            return time.monotonic() - max(self._busy_since, self._last_done) > bound

    def _take(self) -> Job | None:
        """The next job (under the lock), or None once closed: the oldest round when no prompt
        waits or once it has waited ``lead`` tokens, else a prompt by deficit round robin."""
        while not self._ring and not self._rounds:
            if self._closed:
                return None
            self._cv.wait()
        if self._rounds and (not self._ring or self._work - self._rounds[0].mark >= self.lead):
            job = self._rounds.popleft()
            M.ROUND_WAIT_TOKENS.observe(self._work - job.mark)
            return job
        while True:
            tenant = self._ring[0]
            flow = self._flows[tenant]
            if not self._granted:  # the head tenant's turn starts: one quantum more
                self._deficit[tenant] += self.quantum
                self._granted = True
            if flow[0].cost <= self._deficit[tenant]:
                job = flow.popleft()
                self._deficit[tenant] -= job.cost
                if not flow:  # an emptied flow keeps no credit (DRR): it starts afresh next time
                    del self._flows[tenant], self._deficit[tenant]
                    self._ring.popleft()
                    self._granted = False
                return job
            self._ring.rotate(-1)  # its turn is over; the next tenant's starts
            self._granted = False

    def _main(self) -> None:
        if self._threads:
            import torch

            torch.set_num_threads(self._threads)  # OpenMP settings are per thread
        while True:
            with self._cv:
                job = self._take()
                if job is None:
                    return
                self._running = job
                M.MODEL_QUEUE.set(self._queued())
            if not job.future.set_running_or_notify_cancel():
                with self._cv:
                    self._running = None
                continue
            self._emit("start", job)
            error: BaseException | None = None
            try:
                result = job.fn(*job.args)
            except BaseException as e:  # noqa: BLE001 - the waiter gets it
                error = e
            # Not pending any more before its waiter wakes: the waiter may look at ``pending`` next.
            with self._cv:
                self._running = None
                self._last_done = time.monotonic()
                if job.kind != ROUND:
                    self._work += job.cost if job.work is None else job.work
            self._emit("done", job)
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

    def _emit(self, event: str, job: Job) -> None:
        for hook in list(self.hooks):
            hook(event, job)

    def close(self, wait: bool = True) -> None:
        """Cancels the queued jobs; the running one finishes."""
        with self._cv:
            self._closed = True
            for job in [*(j for flow in self._flows.values() for j in flow), *self._rounds]:
                job.future.cancel()
            self._flows.clear()
            self._ring.clear()
            self._deficit.clear()
            self._rounds.clear()
            self._granted = False
            self._cv.notify_all()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
