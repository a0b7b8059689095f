"""Sessions placed where their prompt's prefix is cached, by what the verifiers report.

Two real verifiers (in process, on their own ports) and two gateways over both. A tenant's first
session leaves its system prompt's blocks in one verifier's prefix cache; that verifier is then
made the more loaded of the two (streams held open on it, as another gateway's turns would), and
still both gateways send the tenant's later sessions to it. Saturated, it gets none. Restarted
(a cold cache, a new epoch), it gets no stale affinity: the later sessions go by load again.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from common.prefix import chain_keys, key_id
from racer import launch as services
from racer.client import Client
from racer.procs import socket_dir
from tests.services.test_placement import _stats, holder, other_gateway_streams
from tests.support.engine import hf_greedy
from tests.support.stack import INTERNAL_TOKEN, Stack, prompt, start_drafter, start_gateway, wait_until
from tests.verifier.test_batch_invariance import make_wide_llama
from tests.verifier.test_prefix_cache import native_tile, needs_native

BLOCK = 16
BACKEND = {"prefix_block_tokens": BLOCK, "max_cache_tokens": 8192, "measure_cost": False}
SYSTEM = prompt(300, 4 * BLOCK)
N = 6


def _start_verifier(loop_thread, model, host: str = "127.0.0.1", **settings):
    """``host``: ``unix:PATH`` for a verifier restarted at the same address (a port could be taken)."""
    settings = {**BACKEND, **settings}
    args = services.defaults("verifier", host=host, port=0, max_sessions=16, internal_token=INTERNAL_TOKEN, **settings)
    return loop_thread.run(services.start_verifier(args, model=model))


@pytest.fixture(scope="module")
def stacks(loop_thread, tiny_llama):
    st = Stack(loop_thread)
    sockets = [f"unix:{socket_dir() / f'prefix-verifier-{i}-{id(st):x}.sock'}" for i in range(2)]
    st.verifiers = [_start_verifier(loop_thread, tiny_llama, host) for host in sockets]
    st.drafters = [start_drafter(loop_thread, internal_token=INTERNAL_TOKEN)]
    over = dict(drafters=st.drafter_target(0), verifiers=f"{st.verifier_target(0)},{st.verifier_target(1)}")
    gateways = [
        start_gateway(loop_thread, tiny_llama.config.vocab_size, internal_token=INTERNAL_TOKEN, **over)
        for _ in range(2)
    ]
    st.gateway_pair = gateways[0]
    for _, core in gateways:
        core.backends.load_every = 0.0  # every placement asks the verifiers afresh
    yield st, gateways
    loop_thread.run(gateways[1][0].stop(0))
    st.stop()


def _target(pair) -> str:
    return f"127.0.0.1:{pair[0].port}"


def _session(gateway: str, user_seed: int, tiny_llama) -> str:
    """A new session of the local tenant with the system prompt: its id (its output checked)."""
    p = SYSTEM + prompt(user_seed, 7)
    with Client(gateway, timeout=60) as c:
        ids, _, last = c.complete(p, max_new_tokens=N, budget=4)
    assert ids == hf_greedy(tiny_llama, p, N)
    return last.session_id


def _holds_system_prompt(st, i: int, tenant: str) -> bool:
    held = set(_stats(st.verifier_target(i)).prefix_blocks)
    return all(key_id(k) in held for k in chain_keys(tenant, SYSTEM, BLOCK))


def _placements(by: str) -> float:
    return REGISTRY.get_sample_value("racer_verifier_placements_total", {"by": by}) or 0.0


def _sees(loop_thread, pair, st, i: int, epoch: int) -> bool:
    """The gateway's last report of verifier ``i`` is from the process of ``epoch``, answering."""
    backends = pair[1].backends
    loop_thread.run(backends.refresh_loads(backends.verifiers.live()))
    load = backends.loads.get(st.verifier_target(i))
    return load is not None and load.epoch == epoch and not load.silent


def test_later_sessions_follow_the_prefix_from_both_gateways_unless_restarted_or_saturated(
    stacks, loop_thread, tiny_llama
):
    st, gateways = stacks
    first = _session(_target(gateways[0]), 1, tiny_llama)
    home = holder(st, first)
    tenant = next(s.tenant for s in st.verifier_sessions(home) if s.session_id == first)
    wait_until(lambda: _holds_system_prompt(st, home, tenant), what="the system prompt's blocks reported")
    assert not _holds_system_prompt(st, 1 - home, tenant)
    by_prefix = _placements("prefix")
    with other_gateway_streams(st.verifier_target(home), 3, "busy-"):  # home is now the busier one
        assert _stats(st.verifier_target(home)).saturation > _stats(st.verifier_target(1 - home)).saturation
        for i in range(4):
            sid = _session(_target(gateways[i % 2]), 10 + i, tiny_llama)
            assert holder(st, sid) == home, f"session {i} (gateway {i % 2}) left the prefix"
    assert _placements("prefix") == by_prefix + 4
    assert not _holds_system_prompt(st, 1 - home, tenant)

    # Restarted at its address: a cold cache under a new epoch. The busier again, it gets no session.
    srv, svc = st.verifiers[home]
    address, old_epoch = srv.address, svc.epoch
    loop_thread.run(srv.stop(0))
    svc.close()
    st.verifiers[home] = _start_verifier(loop_thread, tiny_llama, address)
    epoch = st.verifiers[home][1].epoch
    assert epoch != old_epoch
    for pair in gateways:
        wait_until(lambda pair=pair: _sees(loop_thread, pair, st, home, epoch), what="the restarted verifier's report")
    with other_gateway_streams(st.verifier_target(home), 3, "again-"):
        for i in range(2):
            sid = _session(_target(gateways[i]), 20 + i, tiny_llama)
            assert holder(st, sid) == 1 - home, "a restarted verifier kept its stale affinity"
    new_home = 1 - home
    wait_until(lambda: _holds_system_prompt(st, new_home, tenant), what="the blocks on the other verifier")

    # Saturated (KV reservations past 80% of its memory), the holder gets none of the new sessions.
    core = st.verifiers[new_home][1]
    mem = core.kv_memory
    rows = int(0.82 * mem.total - (mem.used - core.prefix_bytes)) // mem.per_token
    with other_gateway_streams(st.verifier_target(new_home), 1, "full-", reserve=rows - 12 - core.headroom):
        assert _stats(st.verifier_target(new_home)).saturation >= 1
        assert _holds_system_prompt(st, new_home, tenant)
        for i in range(2):
            sid = _session(_target(gateways[i]), 30 + i, tiny_llama)
            assert holder(st, sid) == home, "a saturated verifier was given a new session"


@pytest.fixture(scope="module")
def bf16_fused(tmp_path_factory):
    """SmolLM2's head size in bfloat16 on the native decoder (a native row tile forced)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RACER_KERNELS", native_tile() or "linear")
    mp.setenv("RACER_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield make_wide_llama(dtype=torch.bfloat16)
    mp.undo()


@needs_native
def test_bf16_outputs_through_a_stack_are_bit_for_bit_those_without_the_cache(loop_thread, bf16_fused):
    """Reduced precision on the native decoder: a tenant's sessions that copy their system prompt's
    rows from the cache emit what the same sessions emit with the cache off, drafts and all."""
    outs, hits = {}, {}
    for on in (True, False):
        st = Stack(loop_thread)
        st.verifiers = [_start_verifier(loop_thread, bf16_fused, prefix_cache=on)]
        st.drafters = [start_drafter(loop_thread, internal_token=INTERNAL_TOKEN)]
        st.gateway_pair = start_gateway(
            loop_thread,
            bf16_fused.config.vocab_size,
            drafters=st.drafter_target(0),
            verifiers=st.verifier_target(0),
            internal_token=INTERNAL_TOKEN,
        )
        try:
            before = _lookups("hit")
            with Client(st.gateway, timeout=120) as c:
                outs[on] = [c.complete(SYSTEM + prompt(40 + i, 7), max_new_tokens=24, budget=8)[0] for i in range(3)]
            hits[on] = _lookups("hit") - before
        finally:
            st.stop()
    assert hits == {True: 2, False: 0}
    assert outs[True] == outs[False]


def _lookups(outcome: str) -> float:
    return REGISTRY.get_sample_value("racer_verifier_prefix_cache_lookups_total", {"outcome": outcome}) or 0.0
