"""The tenant corpus through real servers: a tenant's sessions draft from its earlier responses,
never another tenant's; opting out, the tenant switch and erasing all hold; output stays greedy."""

from __future__ import annotations

import pytest

from common.v1 import drafter_pb2 as dpb
from common.v1 import drafter_pb2_grpc as dgrpc
from racer.client import Client
from tests.support.corpus import drafts_after
from tests.support.engine import hf_greedy
from tests.support.stack import INTERNAL_TOKEN, backend_channel, prompt, start_drafter, start_stack

N = 40


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    keys, limits = d / "keys", d / "limits.toml"
    keys.write_text("key-a acme\nkey-b globex\nkey-p private\nkey-e erased\nkey-w whole\n")
    limits.write_text("[tenants.private]\nshare = false\n")
    # One drafter behind the gateway: a tenant's sessions meet its corpus whichever session id they get.
    st = start_stack(loop_thread, tiny_llama, drafters=1, api_keys=str(keys), tenant_limits=str(limits))
    yield st
    st.stop()


@pytest.fixture(scope="module")
def fresh_drafter(loop_thread):
    """A drafter no gateway talks to: it never sees any tenant's text but what a test sends it."""
    srv, _ = start_drafter(loop_thread, internal_token=INTERNAL_TOKEN)
    yield f"127.0.0.1:{srv.port}"
    loop_thread.run(srv.stop(0))


def _stats(last):
    s = last.stats
    return s.rounds, s.drafted, s.accepted


def test_a_repeated_prompt_drafts_from_the_tenants_earlier_answer_and_stays_greedy(stack, tiny_llama):
    p = prompt(11, 16)
    with Client(stack.gateway, api_key="key-a", timeout=60) as a:
        first = a.complete(p, max_new_tokens=N, budget=16)
        again = a.complete(p, max_new_tokens=N, budget=16)  # a new session of the same tenant
    assert first[0] == again[0] == hf_greedy(tiny_llama, p, N)
    assert again[2].session_id != first[2].session_id
    assert again[2].stats.rounds < first[2].stats.rounds, (_stats(first[2]), _stats(again[2]))


def test_a_finished_response_is_in_the_corpus_whole_when_the_turn_ends(stack):
    """No step follows a turn's last round: its tokens reach the drafter with the turn's end, and the
    sync the tenant's next open runs finds every token of the response."""
    p = prompt(18, 16)
    with Client(stack.gateway, api_key="key-w", timeout=60) as c:
        c.complete(p, max_new_tokens=4, budget=16, share=False)  # the tenant's corpus is loaded
        out = c.complete(p, max_new_tokens=N, budget=16)[0]
    core = stack.drafters[0][1]
    stack.lt.run(core.corpora.sync(["whole"]))
    corpus = core.corpora.current("whole")
    assert len(out) == N and corpus.tok[: corpus.total].tolist() == out


def test_a_turn_that_opts_out_adds_nothing(stack):
    p = prompt(12, 16)
    with Client(stack.gateway, api_key="key-b", timeout=60) as b:
        first = b.complete(p, max_new_tokens=N, budget=16, share=False)
        again = b.complete(p, max_new_tokens=N, budget=16, share=False)  # nothing was added: drafts as the first
        b.complete(p, max_new_tokens=N, budget=16)  # this answer is added...
        fourth = b.complete(p, max_new_tokens=N, budget=16, share=False)  # ...and drafted from
    assert first[0] == again[0] == fourth[0]
    assert _stats(first[2]) == _stats(again[2])
    assert fourth[2].stats.rounds < first[2].stats.rounds


def test_a_tenant_that_does_not_share_has_no_corpus(stack):
    p = prompt(13, 16)
    with Client(stack.gateway, api_key="key-p", timeout=60) as c:
        runs = [c.complete(p, max_new_tokens=N, budget=16) for _ in range(3)]
    assert len({tuple(r[0]) for r in runs}) == 1
    assert len({_stats(r[2]) for r in runs}) == 1


def _erase(target: str, tenant: str) -> bool:
    with backend_channel(target) as ch:
        return dgrpc.DrafterStub(ch).EraseCorpus(dpb.EraseCorpusRequest(tenant=tenant), timeout=10).existed


def test_an_erased_corpus_drafts_nothing_it_held(stack):
    p = prompt(14, 16)
    with Client(stack.gateway, api_key="key-e", timeout=60) as c:
        first = c.complete(p, max_new_tokens=N, budget=16, share=False)
        c.complete(p, max_new_tokens=N, budget=16)
        assert c.complete(p, max_new_tokens=N, budget=16, share=False)[2].stats.rounds < first[2].stats.rounds
        assert _erase(stack.drafter_target(0), "erased")
        after = c.complete(p, max_new_tokens=N, budget=16, share=False)
    assert after[0] == first[0] and _stats(after[2]) == _stats(first[2])


def test_b_drafts_on_a_drafter_that_saw_a_canary_as_on_one_that_never_did(stack, fresh_drafter):
    canary = prompt(15, 48)
    probe = prompt(16, 6) + canary[:8]
    roots = canary[8:20]
    seen, fresh = stack.drafter_target(0), fresh_drafter
    for i in range(3):  # tenant A repeats the canary on drafter 0
        drafts_after(seen, "acme", f"canary-{i}", prompt(17 + i, 4), canary)
    mine = drafts_after(seen, "acme", "probe-a", probe, roots)
    theirs_seen = drafts_after(seen, "globex", "probe-b", probe, roots)
    theirs_fresh = drafts_after(fresh, "globex", "probe-b", probe, roots)
    assert theirs_seen == theirs_fresh, "tenant A's canary shaped tenant B's drafts"
    # the test could fail: the same probe as A drafts the canary from A's corpus
    assert mine != theirs_seen
    assert any(len(t[0]) > len(o[0]) for t, o in zip(mine, theirs_seen))
