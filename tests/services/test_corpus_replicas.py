"""The tenant corpus across two real drafter processes and a real Redis: replication, restart,
opt-out and erase. What one replica's sessions of a tenant wrote is drafted from on the other."""

from __future__ import annotations

import grpc
import pytest

from common.v1 import drafter_pb2 as dpb
from common.v1 import drafter_pb2_grpc as dgrpc
from racer.cli import main as racer_cli
from tests.support.corpus import drafts_after
from tests.support.procs import Proc, reap
from tests.support.stack import INTERNAL_TOKEN, prompt, wait_until


@pytest.fixture(scope="module")
def drafters(redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("corpus-replicas")
    env = dict(RACER_SNAPSHOT_URL=redis_url, RACER_PRIOR="none")
    procs = [Proc("drafter", env, logs, name=f"drafter{i}").start() for i in range(2)]
    for p in procs:
        p.wait_healthy()
    yield procs
    reap(procs)


def _tokens(p: Proc, tenant: str) -> float:
    return p.metric("racer_corpus_tokens", tenant=tenant)


CANARY = prompt(40, 60)
PROBE = prompt(41, 6) + CANARY[:8]
ROOTS = CANARY[8:20]


def _probe(p: Proc, tenant: str, sid: str) -> list[tuple]:
    return drafts_after(p.target, tenant, sid, PROBE, ROOTS, share=False)


def test_a_response_through_one_replica_is_drafted_from_on_the_other_and_survives_a_restart(drafters):
    one, two = drafters
    t = "rep-tenant"
    drafts_after(two.target, t, "warm", prompt(42, 4), [5])  # two loads the tenant's (empty) corpus
    drafts_after(one.target, t, "writer", prompt(43, 4), CANARY)  # 59 tokens committed through one
    wait_until(lambda: _tokens(two, t) >= len(CANARY) - 1, 20, "the canary on replica two")
    wait_until(lambda: _tokens(one, t) >= len(CANARY) - 1, 20, "the canary on replica one")
    on_two, on_one = _probe(two, t, "p2"), _probe(one, t, "p1")
    fresh = _probe(two, "rep-other", "p3")
    assert on_two == on_one  # both replicas index the same stream, in the same order
    assert on_two != fresh and sum(len(x[0]) for x in on_two) > sum(len(x[0]) for x in fresh)
    # a restarted replica rebuilds the corpus from Redis: nothing is lost
    two.kill()
    two.start().wait_healthy()
    drafts_after(two.target, t, "warm-again", prompt(44, 4), [5])
    wait_until(lambda: _tokens(two, t) >= len(CANARY) - 1, 20, "the corpus reloaded on replica two")
    assert _probe(two, t, "p4") == on_one
    assert two.metric("racer_corpus_load_seconds_count") >= 1


def test_opt_out_and_erase_hold_on_every_replica_and_after_a_restart(drafters, monkeypatch, capsys):
    one, two = drafters
    t = "erase-tenant"
    drafts_after(two.target, t, "warm", prompt(45, 4), [5])
    fresh = _probe(two, t, "before")
    drafts_after(one.target, t, "private", prompt(46, 4), CANARY, share=False)  # opted out: never added
    marker = prompt(47, 12)
    drafts_after(one.target, t, "marker", prompt(48, 4), marker)  # published after the private turn
    wait_until(lambda: _tokens(two, t) >= len(marker) - 1, 20, "the marker on replica two")
    assert _tokens(two, t) == len(marker) - 1  # the marker only: the private turn added nothing
    assert _probe(two, t, "after-private") == fresh
    drafts_after(one.target, t, "writer", prompt(49, 4), CANARY)
    wait_until(lambda: _tokens(two, t) >= len(marker) + len(CANARY) - 2, 20, "the canary on replica two")
    assert _probe(two, t, "shared") != fresh
    with pytest.raises(grpc.RpcError) as refused, grpc.insecure_channel(one.target) as ch:
        dgrpc.DrafterStub(ch).EraseCorpus(dpb.EraseCorpusRequest(tenant=t), timeout=10)  # no internal token
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    monkeypatch.setenv("RACER_INTERNAL_TOKEN", INTERNAL_TOKEN)
    assert racer_cli(["erase-corpus", t, "--target", one.target]) == 0  # the operator's command
    assert "erased" in capsys.readouterr().out
    wait_until(lambda: _tokens(two, t) == 0, 20, "the erase on replica two")
    assert _probe(two, t, "erased") == fresh
    two.kill()
    two.start().wait_healthy()
    drafts_after(two.target, t, "warm-again", prompt(50, 4), [5])
    wait_until(lambda: two.metric("racer_corpus_load_seconds_count") >= 1, 20, "the reload on replica two")
    assert _tokens(two, t) == 0 and _probe(two, t, "restarted") == fresh  # erased stays erased
