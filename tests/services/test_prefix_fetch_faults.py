"""A verifier's source of prefix blocks dies or stalls mid-transfer: the open prefills, the turn
answers, identical.

Verifiers as processes (``racer serve verifier``). The holder runs with the fault
``RACER_PREFIX_FAULT=stop-mid-transfer``: after it has sent a transfer's first block it stops
itself (SIGSTOP), so the transfer is held half done, for sure, however fast the machine. The test
then kills it (SIGKILL), or leaves it stopped until the receiver's deadline passes. The test calls
the verifiers as a gateway would: the turn's open names the holder (``VerifierOpen.prefix_source``).
All run one forced kernel plan (``RACER_KERNELS``), so their fingerprints are equal whatever a
tuning would have chosen on a loaded machine.
"""

from __future__ import annotations

import threading

import pytest

from tests.services.test_faults import tiny_model_dir  # noqa: F401 - the fixture
from tests.services.test_prefix_fetch import BLOCK, N, _cache, _turn
from tests.support.engine import hf_greedy
from tests.support.procs import reap, verifier_procs
from tests.support.stack import prompt, wait_until

COMMON = {
    "RACER_PREFIX_BLOCK_TOKENS": str(BLOCK),
    "RACER_PREFIX_FETCH": "always",
    "RACER_KERNELS": "linear",
    "RACER_MEASURE_COST": "0",
}


@pytest.fixture(scope="module")
def procs(tmp_path_factory, tiny_model_dir):  # noqa: F811 - the fixture
    tmp = tmp_path_factory.mktemp("prefix-fetch")
    (tmp / "holder").mkdir()
    faulty = dict(COMMON, RACER_PREFIX_FAULT="stop-mid-transfer")
    (holder,) = verifier_procs(1, tiny_model_dir, tmp / "holder", faulty)
    # The receiver that sees its source killed waits for it as long as a loaded machine may need (a
    # hang guard); the one that sees it stalled gives up after a few seconds (what is tested there).
    patient, hasty = verifier_procs(2, tiny_model_dir, tmp, COMMON)
    patient.env["RACER_PREFIX_FETCH_SECONDS"] = "600"
    hasty.env["RACER_PREFIX_FETCH_SECONDS"] = "3"
    started = [holder, patient, hasty]
    try:
        for p in started:
            p.start()
        for p in started:
            p.wait_healthy()
        yield holder, patient, hasty
    finally:
        reap(started)


def _fingerprint(p) -> str:
    return p.setup().prefix_fingerprint


def test_a_source_killed_mid_transfer_costs_a_prefill_and_the_turn_answers_identical(procs, tiny_llama):
    holder, receiver, _ = procs
    assert _fingerprint(holder) == _fingerprint(receiver)
    history = prompt(400, 4 * BLOCK) + prompt(6, 7)
    _cache(holder.target, "frank", "killed-a", history)
    result = {}

    def turn():
        result["out"] = _turn(receiver.target, "frank", "killed-b", history, (holder.target, 4), N)

    t = threading.Thread(target=turn)
    t.start()
    wait_until(holder.stopped, timeout=120, what="the holder stopped mid-transfer")
    holder.kill()
    t.join(300)
    assert not t.is_alive()
    out, opened = result["out"]
    assert out == hf_greedy(tiny_llama, history, N)
    assert opened.prefix_tokens == 0 and opened.fetched_tokens == 0
    assert receiver.metric("racer_verifier_prefix_fetch_refused_total", reason="source") == 1
    assert receiver.metric("racer_verifier_prefix_fetched_blocks_total") == 0
    holder.start().wait_healthy()


def test_a_source_killed_mid_hand_over_costs_a_prefill_and_the_turn_answers_identical(procs, tiny_llama):
    """A hand-over (the session's own rows, past the prefix cache's blocks): its source dies after the
    first block; the receiver prefills the whole history and answers as without a move."""
    holder, receiver, _ = procs
    first = prompt(420, 4 * BLOCK) + prompt(8, 7)
    out, _ = _turn(holder.target, "heidi", "moving", first, None, 2 * BLOCK)  # rows past the cached blocks
    history = first + out + prompt(9, 5)
    refused = receiver.metric("racer_verifier_prefix_transfer_refused_total", use="handover", reason="source")
    result = {}

    def turn():
        source = (holder.target, len(history) // BLOCK, "moving")
        result["out"] = _turn(receiver.target, "heidi", "moving", history, source, N)

    t = threading.Thread(target=turn)
    t.start()
    wait_until(holder.stopped, timeout=120, what="the holder stopped mid-hand-over")
    holder.kill()
    t.join(300)
    assert not t.is_alive()
    got, opened = result["out"]
    assert got == hf_greedy(tiny_llama, history, N)
    assert opened.prefix_tokens == 0 and opened.fetched_tokens == 0
    assert (
        receiver.metric("racer_verifier_prefix_transfer_refused_total", use="handover", reason="source") == refused + 1
    )
    assert receiver.metric("racer_verifier_prefix_handover_rows_total", side="received") == 0
    holder.start().wait_healthy()


def test_a_source_stopped_mid_transfer_costs_a_prefill_after_the_deadline(procs, tiny_llama):
    holder, _, receiver = procs
    history = prompt(410, 4 * BLOCK) + prompt(7, 7)
    _cache(holder.target, "grace", "stopped-a", history)
    out, opened = _turn(receiver.target, "grace", "stopped-b", history, (holder.target, 4), N)
    assert holder.stopped()  # the transfer stalled after its first block, and still does
    assert out == hf_greedy(tiny_llama, history, N)
    assert opened.prefix_tokens == 0 and opened.fetched_tokens == 0
    assert receiver.metric("racer_verifier_prefix_fetch_refused_total", reason="deadline") == 1
    assert receiver.metric("racer_verifier_prefix_fetched_blocks_total") == 0
