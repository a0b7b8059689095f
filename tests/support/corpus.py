"""Drafter sessions driven by hand, for the tenant corpus tests."""

from __future__ import annotations

import queue

from common.v1 import drafter_pb2 as dpb
from common.v1 import drafter_pb2_grpc as dgrpc

from .stack import backend_channel

TOPK = 8


def drafts_after(target: str, tenant: str, sid: str, history: list[int], steps=(), share: bool = True) -> list[tuple]:
    """Opens (tenant, sid) with ``history`` and drafts a tree for each token of ``steps``, accepting
    only its root each time (so each token is committed and, when the tenant shares, added to its
    corpus); the trees, as (tokens, parents)."""
    q: queue.Queue = queue.Queue()
    trees = []
    with backend_channel(target) as ch:
        responses = dgrpc.DrafterStub(ch).Session(iter(q.get, None), timeout=30)
        q.put(
            dpb.DraftRequest(open=dpb.DrafterOpen(session_id=sid, tenant=tenant, history=history, no_share=not share))
        )
        next(responses)
        n = 0
        for i, root in enumerate(steps):
            fb = dict(tree_topk=[0] * (n * TOPK), accepted=[0], commit=1) if i else {}
            q.put(dpb.DraftRequest(step=dpb.DraftStep(root=root, budget=32, mode="racer", **fb)))
            tree = next(responses).tree
            n = len(tree.tokens)
            trees.append((tuple(tree.tokens), tuple(tree.parents)))
        q.put(None)
        responses.cancel()
    return trees
