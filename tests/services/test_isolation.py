"""Tenants: one tenant's text never shapes another's drafts, every call needs a key, ids cannot be
guessed or aliased."""

from __future__ import annotations

import queue
import re

import grpc
import pytest

from common.v1 import drafter_pb2 as dpb
from common.v1 import drafter_pb2_grpc as dgrpc
from common.v1 import generation_pb2 as pb
from common.v1 import generation_pb2_grpc as pb_grpc
from gateway.auth import load_api_keys
from racer.client import Client
from tests.support.stack import backend_channel, prompt, start_stack


@pytest.fixture(scope="module")
def stack(loop_thread, tiny_llama, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("key-a acme\nkey-b globex\n")
    st = start_stack(loop_thread, tiny_llama, drafters=1, api_keys=str(keys))
    yield st
    st.stop()


def _drafts(target: str, tenant: str, session_id: str, history: list[int], root: int) -> tuple:
    """The tree a drafter sends for ``root`` right after opening (tenant, session_id) with ``history``."""
    q: queue.Queue = queue.Queue()
    with backend_channel(target) as ch:
        responses = dgrpc.DrafterStub(ch).Session(iter(q.get, None), timeout=30)
        q.put(dpb.DraftRequest(open=dpb.DrafterOpen(session_id=session_id, tenant=tenant, history=history)))
        next(responses)
        q.put(dpb.DraftRequest(step=dpb.DraftStep(root=root, budget=32, mode="racer")))
        tree = next(responses).tree
        q.put(None)
        responses.cancel()
    return tuple(tree.tokens), tuple(tree.parents)


def test_another_tenants_text_never_shapes_drafts(stack):
    target = stack.drafter_target(0)
    text = prompt(1, 64)
    mine = prompt(2, 8) + text[:20]  # tenant B's history shares a prefix with what tenant A wrote
    before = _drafts(target, "globex", "same-id", mine, text[20])
    # tenant A fills a session with the same id (and others) with text that would make B's drafts far better
    for sid in ("same-id", "other-id"):
        _drafts(target, "acme", sid, text * 4, text[20])
    assert len(before[0]) < 32, "B's drafts leave room to improve (else the test could not fail)"
    for sid in ("same-id", "new-id"):  # B's own session again, and a new one
        assert _drafts(target, "globex", sid, mine, text[20]) == before, "tenant A's text changed tenant B's drafts"
    held = {(s.tenant, s.session_id): s.tokens for s in stack.drafter_sessions(0)}
    assert held[("globex", "same-id")] == len(mine) and held[("acme", "same-id")] == len(text) * 4


def test_through_the_gateway_b_speculates_the_same_whatever_a_did(stack):
    p = prompt(3, 20)
    with (
        Client(stack.gateway, api_key="key-b", timeout=60) as b,
        Client(stack.gateway, api_key="key-a", timeout=60) as a,
    ):
        # B's turns opt out of its own corpus, so only A's text could change B's drafts.
        first = b.complete(p, max_new_tokens=30, budget=16, share=False)
        for _ in range(2):  # A sends B's prompt and B's answer: a shared structure would now predict it all
            a.complete(p + first[0] + p, max_new_tokens=30, budget=16)
        again = b.complete(p, max_new_tokens=30, budget=16, share=False)
    assert again[0] == first[0]
    s1, s2 = first[2].stats, again[2].stats
    assert (s1.rounds, s1.drafted, s1.accepted) == (s2.rounds, s2.drafted, s2.accepted)


def test_every_call_needs_a_key(stack):
    with Client(stack.gateway, api_key="key-a", timeout=30) as a:
        sid = a.complete(prompt(4, 16), max_new_tokens=3)[2].session_id
    for md in ((), (("authorization", "Bearer nope"),), (("authorization", "key-a"),), (("x-api-key", "nope"),)):
        with grpc.insecure_channel(stack.gateway) as ch:
            stub = pb_grpc.GenerationStub(ch)
            calls = [
                lambda: list(
                    stub.Generate(pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[5])), metadata=md, timeout=10)
                ),
                lambda: stub.GetSession(pb.SessionRef(session_id=sid), metadata=md, timeout=10),
                lambda: stub.CloseSession(pb.SessionRef(session_id=sid), metadata=md, timeout=10),
                lambda: stub.ListSessions(pb.ListSessionsRequest(), metadata=md, timeout=10),
            ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(stack.gateway) as ch:  # x-api-key works as documented
        got = pb_grpc.GenerationStub(ch).GetSession(pb.SessionRef(session_id=sid), metadata=(("x-api-key", "key-a"),))
    assert got.turns == 1


def test_session_ids_are_unguessable(stack):
    with Client(stack.gateway, api_key="key-a", timeout=30) as a:
        sids = [a.complete([5, 6], max_new_tokens=1)[2].session_id for _ in range(40)]
    assert len(set(sids)) == len(sids)
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{24}", s) for s in sids)  # 144 random bits each (secrets.token_urlsafe)
    chars = "".join(sids)
    assert len(set(chars)) > 40, "ids do not look random"


def test_tenant_names_cannot_alias_store_keys(tmp_path):
    keys = tmp_path / "keys"
    for bad in ("k1 acme:ops\n", "k1 a*\n", "k1 " + "x" * 65 + "\n"):
        keys.write_text(bad)
        with pytest.raises(ValueError, match="tenant"):
            load_api_keys(str(keys))
    keys.write_text("k1 acme\nk2 acme.ops\n")
    assert load_api_keys(str(keys)) == {"k1": "acme", "k2": "acme.ops"}
