"""Shared pieces of the engine tests: references from transformers, scripted drafters, a recorder."""

from __future__ import annotations

import random
from dataclasses import dataclass

from racer.bench.reference import hf_greedy, run, run_racer
from verifier.engine import VerifierSession

from .models import single_thread

__all__ = ["RecordingVerifier", "ScriptedDrafter", "Tree", "hf_greedy", "run", "run_racer", "single_thread"]


@dataclass(frozen=True)
class Tree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]


class ScriptedDrafter:
    """A drafter that knows the true continuation (``truth`` = prompt + greedy output) and drafts
    trees of a chosen kind. It implements the loop's Drafter protocol and checks how it is used.

    kinds:
      wrong  -- every child of the root is a token the target will not choose; deeper nodes hang
                under wrong children (so nothing but the root can ever be accepted)
      exact  -- the true continuation as a chain of ``budget`` nodes
      near   -- the true continuation, its last node replaced by a wrong token, the right tokens
                also placed under wrong parents and at wrong depths, duplicates of wrong siblings
      random -- random shape, random tokens
    """

    def __init__(self, truth: list[int], vocab: int, kind: str, seed: int = 0):
        self.truth = truth
        self.vocab = vocab
        self.kind = kind
        self.rng = random.Random(seed)
        self.history: list[int] = []
        self.expected_accepts: list[int] = []  # accepted nodes beyond the root this drafter designed

    # -- protocol -----------------------------------------------------------------------------------
    def extend(self, tokens, topk_rows=None) -> None:
        tokens = list(tokens)
        if topk_rows is not None:
            assert len(topk_rows) <= len(tokens)  # the last tokens' rows
        self.history += tokens

    def observe_tree(self, tree_tokens, tree_topk, accepted) -> None:
        assert len(tree_topk) == len(tree_tokens)
        assert accepted[0] == 0

    def draft(self, root: int, budget: int, mode: str) -> Tree:
        h = len(self.history)
        assert self.history == self.truth[:h], "the loop committed tokens the target did not choose"
        assert root == self.truth[h], "the root must be the target's own choice"
        ahead = self.truth[h + 1 : h + budget]  # the next tokens the target will choose
        return getattr(self, "_" + self.kind)(root, budget, ahead)

    # -- tree kinds ---------------------------------------------------------------------------------
    def _wrong_token(self, avoid: int) -> int:
        t = self.rng.randrange(self.vocab - 1)
        return t if t < avoid else t + 1

    def _wrong(self, root, budget, ahead):
        right = ahead[0] if ahead else -1
        kids = [t for t in range(self.vocab) if t != right]
        self.rng.shuffle(kids)
        tokens, parents = [root], [-1]
        for t in kids[: min(budget - 1, 8)]:
            tokens.append(t)
            parents.append(0)
        while len(tokens) < budget:  # deeper nodes under wrong children: the right tokens included
            p = self.rng.randrange(1, len(tokens)) if len(tokens) > 1 else 0
            if p == 0:
                tokens.append(self._wrong_token(right))
            else:
                tokens.append(
                    self.rng.choice(ahead) if ahead and self.rng.random() < 0.5 else self.rng.randrange(self.vocab)
                )
            parents.append(p)
        self.expected_accepts.append(0)
        return Tree(tuple(tokens), tuple(parents))

    def _exact(self, root, budget, ahead):
        tokens = [root, *ahead]
        self.expected_accepts.append(len(ahead))
        return Tree(tuple(tokens), (-1, *range(len(tokens) - 1)))

    def _near(self, root, budget, ahead):
        if budget < 3 or len(ahead) < 2:
            return self._wrong(root, budget, ahead)
        good = ahead[: budget // 2]
        chain = good[:-1] + [self._wrong_token(good[-1])]  # the last guess is wrong
        nodes = [(-1, root)]
        for i, t in enumerate(chain):  # chain node i+1 is the child of node i
            nodes.append((i, t))
        while len(nodes) < budget:
            p = self.rng.randrange(len(nodes))
            depth = 0
            q = p
            while q > 0:
                q = nodes[q][0]
                depth += 1
            on_chain = p <= len(chain) - 1 and p == depth  # nodes 0..len(chain)-1 are the good chain
            if on_chain and depth < len(good):  # never another right child of a good node
                t = self._wrong_token(good[depth])
            else:
                t = self.rng.choice(ahead)  # a right token at the wrong place
            nodes.append((p, t))
        # shuffle breadth-first order within each depth so the accepted nodes are not contiguous
        depth_of = [0]
        for p, _ in nodes[1:]:
            depth_of.append(depth_of[p] + 1)
        keys = {i: (depth_of[i], self.rng.random()) for i in range(1, len(nodes))}
        order = [0] + sorted(range(1, len(nodes)), key=keys.__getitem__)
        new = {old: i for i, old in enumerate(order)}
        tokens = tuple(nodes[o][1] for o in order)
        parents = tuple(-1 if o == 0 else new[nodes[o][0]] for o in order)
        self.expected_accepts.append(len(good) - 1)
        return Tree(tokens, parents)

    def _random(self, root, budget, ahead):
        n = self.rng.randint(1, budget)
        parents = [-1] + [self.rng.randrange(i) for i in range(1, n)]
        tokens = [root] + [
            self.rng.choice(ahead) if ahead and self.rng.random() < 0.3 else self.rng.randrange(self.vocab)
            for _ in range(n - 1)
        ]
        self.expected_accepts.append(-1)  # unknown
        return Tree(tuple(tokens), tuple(parents))


class RecordingVerifier:
    """Wraps a VerifierSession and keeps every (tokens, parents, result) it verified."""

    def __init__(self, inner: VerifierSession):
        self.inner = inner
        self.rounds: list[tuple[list[int], list[int], object]] = []

    def prefill(self, tokens, topk_rows=None):
        return self.inner.prefill(tokens, topk_rows=topk_rows)

    def verify(self, tokens, parents):
        res = self.inner.verify(tokens, parents)
        self.rounds.append((list(tokens), list(parents), res))
        return res

    @property
    def length(self) -> int:
        return self.inner.length

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)
