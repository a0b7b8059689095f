"""Prefix blocks fetched from the verifier that holds them, instead of prefilled (verifier/prefix_fetch.py).

Verifiers in this process on their own addresses, real gRPC between them and from a gateway whose
sessions live in Redis. A tenant's first session leaves its system prompt's blocks on one verifier;
saturated, that verifier gets no new session, and the gateway names it to the verifier that gets
the tenant's next session, which fetches the blocks and prefills only the rest. A holder that
ignores the scope, one that sends corrupt rows and a receiver whose kernels differ are each caught:
the open prefills, and every output is transformers' greedy output (what a cold prefill gives).
"""

from __future__ import annotations

import contextlib
import queue

import pytest
from prometheus_client import REGISTRY

from common.prefix import chain_keys, key_id
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc
from racer import launch as services
from racer.bench.tiny import make_tiny_llama
from racer.client import Client
from tests.services.test_placement import _stats, holder, other_gateway_streams
from tests.support.engine import hf_greedy
from tests.support.stack import INTERNAL_TOKEN, Stack, backend_channel, prompt, start_drafter, start_gateway, wait_until
from verifier.prefix_fetch import Rates, layout, pack, unpack

BLOCK = 16
BACKEND = {"prefix_block_tokens": BLOCK, "max_cache_tokens": 8192, "measure_cost": False, "prefix_fetch": "always"}
SYSTEM = prompt(300, 4 * BLOCK)
N = 6


@pytest.fixture(scope="module", autouse=True)
def _one_plan():
    """Every verifier of the module runs one forced kernel plan (``RACER_KERNELS``): verifiers that
    each measured their own on a loaded machine could choose differently, and their fingerprints
    would differ (the blocks then rightly stay where they are)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RACER_KERNELS", "linear")
    yield
    mp.undo()


def _start_verifier(loop_thread, model, **settings):
    settings = {"internal_token": INTERNAL_TOKEN, **BACKEND, **settings}
    args = services.defaults("verifier", host="127.0.0.1", port=0, max_sessions=16, **settings)
    return loop_thread.run(services.start_verifier(args, model=model))


def _value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _metrics() -> dict[str, float]:
    names = {
        "fetched": ("racer_verifier_prefix_fetched_blocks_total", {}),
        "served": ("racer_verifier_prefix_served_blocks_total", {}),
        "saved": ("racer_verifier_prefix_cache_saved_tokens_total", {}),
        **{
            r: ("racer_verifier_prefix_fetch_refused_total", {"reason": r})
            for r in ("scope", "fingerprint", "hash", "source", "deadline", "budget")
        },
        "serve_fingerprint": ("racer_verifier_prefix_serve_refused_total", {"reason": "fingerprint"}),
    }
    return {k: _value(n, **ls) for k, (n, ls) in names.items()}


@contextlib.contextmanager
def _delta():
    before, out = _metrics(), {}
    yield out
    after = _metrics()
    out.update({k: after[k] - before[k] for k in after})


@pytest.fixture(scope="module")
def stacks(loop_thread, tiny_llama, redis_url):
    st = Stack(loop_thread)
    st.verifiers = [_start_verifier(loop_thread, tiny_llama) for _ in range(2)]
    st.drafters = [start_drafter(loop_thread, internal_token=INTERNAL_TOKEN)]
    st.gateway_pair = start_gateway(
        loop_thread,
        tiny_llama.config.vocab_size,
        internal_token=INTERNAL_TOKEN,
        session_url=redis_url,
        drafters=st.drafter_target(0),
        verifiers=f"{st.verifier_target(0)},{st.verifier_target(1)}",
    )
    st.gateway_pair[1].backends.load_every = 0.0  # every placement asks the verifiers afresh
    yield st
    st.stop()


def _holds(target: str, scope: str, tokens: list[int], channel=backend_channel) -> bool:
    """Whether the verifier at ``target`` reports (``Stats``, over ``channel(target)``) every block
    of ``tokens`` in ``scope``."""
    with channel(target) as ch:
        held = set(vgrpc.VerifierStub(ch).Stats(vpb.VerifierStatsRequest(), timeout=10).prefix_blocks)
    return all(key_id(k) in held for k in chain_keys(scope, tokens, BLOCK))


def test_a_session_placed_off_its_prefix_fetches_the_blocks_and_prefills_the_rest(stacks, tiny_llama):
    st = stacks
    first = SYSTEM + prompt(1, 7)
    with Client(st.gateway, timeout=120) as c:
        ids, _, last = c.complete(first, max_new_tokens=N, budget=4)
    assert ids == hf_greedy(tiny_llama, first, N)
    home = holder(st, last.session_id)
    other = 1 - home
    tenant = next(s.tenant for s in st.verifier_sessions(home) if s.session_id == last.session_id)
    wait_until(lambda: _holds(st.verifier_target(home), tenant, SYSTEM), what="the system prompt's blocks reported")
    assert not _holds(st.verifier_target(other), tenant, SYSTEM)
    fingerprints = {_stats(st.verifier_target(i)).setup.prefix_fingerprint for i in range(2)}
    assert len(fingerprints) == 1 and "" not in fingerprints

    # The holder saturated (KV reservations past 80% of its memory): the next session goes elsewhere.
    core = st.verifiers[home][1]
    mem = core.kv_memory
    rows = int(0.82 * mem.total - (mem.used - core.prefix_bytes)) // mem.per_token
    later = SYSTEM + prompt(2, 7)
    with other_gateway_streams(st.verifier_target(home), 1, "full-", reserve=rows - 12 - core.headroom):
        assert _stats(st.verifier_target(home)).saturation >= 1
        with _delta() as d, Client(st.gateway, timeout=120) as c:
            ids, _, last = c.complete(later, max_new_tokens=N, budget=4)
    assert holder(st, last.session_id) == other
    assert ids == hf_greedy(tiny_llama, later, N)  # what a cold prefill gives (float32: transformers' greedy)
    assert d["fetched"] == 4 and d["served"] == 4  # the system prompt's four blocks moved
    assert d["saved"] == 4 * BLOCK  # copied, not prefilled: the prefill computed the 7 tokens after them
    assert sum(d[r] for r in ("scope", "fingerprint", "hash", "source", "deadline", "budget")) == 0
    assert _holds(st.verifier_target(other), tenant, SYSTEM)  # the receiver's cache holds them now


# -- straight to the verifiers, as a gateway would call them ------------------------------------------


def _turn(
    target: str, tenant: str, session_id: str, history: list[int], source: tuple | None, n: int, channel=backend_channel
):
    """A turn at the verifier's API, over ``channel(target)``: open (naming ``source``, (address,
    blocks[, session id: a hand-over]), as the blocks' holder), then ``n - 1`` one-token rounds. (the
    tokens, the open's answer)."""
    q: queue.Queue = queue.Queue()
    op = vpb.VerifierOpen(session_id=session_id, tenant=tenant, history=history, reserve_tokens=n)
    if source is not None:
        address, blocks, handover = (*source, "")[:3]
        op.prefix_source.CopyFrom(vpb.PrefixSource(address=address, blocks=blocks, session_id=handover))
    q.put(vpb.VerifyRequest(open=op))
    with channel(target) as ch:
        call = vgrpc.VerifierStub(ch).Session(iter(q.get, None), timeout=120)
        opened = next(call)
        out = [opened.next_token]
        for _ in range(n - 1):
            q.put(vpb.VerifyRequest(tree=vpb.VerifyTree(tokens=[out[-1]], parents=[-1])))
            out.append(next(call).next_token)
        q.put(None)
        for _ in call:
            pass
    return out, opened


def _cache(target: str, tenant: str, session_id: str, history: list[int], channel=backend_channel) -> None:
    """``tenant``'s blocks of ``history`` left in the prefix cache of the verifier at ``target``."""
    _turn(target, tenant, session_id, history, None, 1, channel)
    wait_until(lambda: _holds(target, tenant, history[: 4 * BLOCK], channel), what="the blocks cached")


@pytest.fixture(scope="module")
def faulty(loop_thread, tiny_llama):
    """Holders started with a fault (``RACER_PREFIX_FAULT``, read at start): by fault, (server, core)."""
    started = {}
    mp = pytest.MonkeyPatch()
    for fault in ("ignore-scope", "corrupt"):
        mp.setenv("RACER_PREFIX_FAULT", fault)
        started[fault] = _start_verifier(loop_thread, tiny_llama)
    mp.undo()
    yield started
    for srv, core in started.values():
        loop_thread.run(srv.stop(0))
        core.close()


def _isolated(st, holder_target: str, tag: str, seed: int, tiny_llama) -> bool:
    """The isolation check: tenant alice's system prompt cached on the holder, tenant bob opens the
    same prompt on the other verifier naming that holder. True when no block of alice's crossed to
    bob's request (the holder served none); bob's output is checked either way."""
    history = prompt(seed, 4 * BLOCK) + prompt(3, 7)
    _cache(holder_target, "alice", f"{tag}-a", history)
    receiver = st.verifier_target(0)
    with _delta() as d:
        out, opened = _turn(receiver, "bob", f"{tag}-b", history, (holder_target, 4), N)
    assert out == hf_greedy(tiny_llama, history, N)
    assert opened.fetched_tokens == 0 and opened.prefix_tokens == 0  # bob prefilled all of it
    assert d["fetched"] == 0
    return d["served"] == 0 and d["scope"] == 0


def test_blocks_never_cross_scopes_and_a_holder_that_ignores_the_scope_is_caught(stacks, faulty, tiny_llama):
    st = stacks
    assert _isolated(st, st.verifier_target(1), "good", 310, tiny_llama)
    srv, _ = faulty["ignore-scope"]
    with _delta() as d:
        caught = not _isolated(st, srv.address, "bad", 320, tiny_llama)
    assert caught, "the isolation check missed a holder that serves another scope's blocks"
    assert d["served"] > 0 and d["scope"] == 1  # served across scopes, refused by the receiver


def test_corrupt_rows_are_refused_and_prefilled(stacks, faulty, tiny_llama):
    st = stacks
    srv, _ = faulty["corrupt"]
    history = SYSTEM + prompt(4, 7)
    _cache(srv.address, "carol", "corrupt-a", history)
    with _delta() as d:
        out, opened = _turn(st.verifier_target(0), "carol", "corrupt-b", history, (srv.address, 4), N)
    assert out == hf_greedy(tiny_llama, history, N)
    assert d["hash"] == 1 and d["fetched"] == 0 and opened.prefix_tokens == 0


def test_a_receiver_with_other_kernels_refuses_the_blocks_and_prefills(stacks, loop_thread, tiny_llama):
    """A verifier whose kernel plan was forced (``RACER_KERNELS``) computes rows along another path:
    its fingerprint differs, the holder refuses it, and it prefills."""
    st = stacks
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RACER_KERNELS", "wxt")
        srv, core = _start_verifier(loop_thread, make_tiny_llama())
    try:
        mine = _stats(srv.address).setup.prefix_fingerprint
        assert mine and mine != _stats(st.verifier_target(1)).setup.prefix_fingerprint
        history = SYSTEM + prompt(5, 7)
        _cache(st.verifier_target(1), "dave", "kernels-a", history)
        with _delta() as d:
            out, opened = _turn(srv.address, "dave", "kernels-b", history, (st.verifier_target(1), 4), N)
        assert out == hf_greedy(tiny_llama, history, N)
        assert d["fingerprint"] == 1 and d["serve_fingerprint"] == 1 and d["fetched"] == 0
        assert opened.prefix_tokens == 0
    finally:
        loop_thread.run(srv.stop(0))
        core.close()


# -- the parts ---------------------------------------------------------------------------------------


def test_rows_travel_as_bytes_bit_for_bit(tiny_llama):
    import torch

    lay = layout(tiny_llama.config, "llama", torch.float32, BLOCK)
    rows = torch.randn(lay.shapes[0])
    assert torch.equal(unpack(pack(rows), lay), rows)
    pairs = layout(tiny_llama.config, "hf", torch.bfloat16, BLOCK)
    kv = [(torch.randn(s, dtype=torch.bfloat16), torch.randn(s, dtype=torch.bfloat16)) for s in pairs.shapes[::2]]
    back = unpack(pack(kv), pairs)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv, back))


def test_the_rule_fetches_only_what_is_cheaper_than_its_prefill():
    r = Rates()
    assert r.worth(64, 10**9)  # nothing measured: the first fetch measures the link
    r.prefilled(1000, 2.0)  # 2 ms a token
    r.fetched(100 * 10**6, 0.01, 0.11)  # 1 GB/s after 10 ms
    assert r.worth(3000, 100 * 10**6)  # 0.11 s against 6 s
    assert not r.worth(10, 100 * 10**6)  # 0.11 s against 0.02 s
