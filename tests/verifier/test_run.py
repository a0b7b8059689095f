"""A run (VerifyTree.run) in the verifier's servicer: it ends early when the verifier drains."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from common.v1 import verifier_pb2 as pb
from verifier.service import VerifierService, _VerifyStream
from verifier.sessions import Verified


class _Counting:
    """A verifier core whose next token is the root plus one; ``on_round`` runs after each round."""

    vocab_size = 100
    topk = 2

    def __init__(self, on_round):
        self.on_round = on_round
        self.rounds = 0

    async def verify(self, entry, tokens, parents):
        assert parents == [-1] * len(tokens)
        self.rounds += 1
        self.on_round(self.rounds)
        return Verified(tokens[0] + 1, [0], [0, 0], 10 + self.rounds, 1.0, 0)


def _run(core, servicer, run: int) -> list[pb.VerifyResponse]:
    stream = _VerifyStream(servicer, context=None)
    stream.entry = SimpleNamespace(session=SimpleNamespace(masks=None))

    async def answers():
        return [r async for r in stream.tree(pb.VerifyTree(tokens=[7], parents=[-1], run=run))]

    return asyncio.run(answers())


def test_a_run_ends_at_the_round_after_the_verifier_starts_draining():
    servicer = VerifierService.__new__(VerifierService)
    servicer.draining = False
    core = _Counting(lambda n: setattr(servicer, "draining", n == 3))
    servicer.verifier = core
    got = _run(core, servicer, 10)
    # rounds 1-2 answered with more; round 3 saw the drain: its answer is the run's last
    assert [r.next_token for r in got] == [8, 9, 10]
    assert [r.more for r in got] == [True, True, False]
    assert core.rounds == 3


def test_a_run_without_a_drain_answers_every_round():
    servicer = VerifierService.__new__(VerifierService)
    servicer.draining = False
    core = _Counting(lambda n: None)
    servicer.verifier = core
    got = _run(core, servicer, 5)
    assert [r.next_token for r in got] == [8, 9, 10, 11, 12]
    assert [r.more for r in got] == [True] * 4 + [False]
    assert [r.cache_tokens for r in got] == [11, 12, 13, 14, 15]
