"""The round's bookkeeping keeps committed = prompt + emitted, minus the last, however a round ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.loop import Rounds, generate
from common.params import GenerationParams


def test_a_full_round_commits_the_path_and_roots_at_the_bonus():
    r = Rounds([1, 2], GenerationParams(max_new_tokens=10, stop_token_ids=(99,)))
    assert r.start(5) == ([5], False) and r.root == 5
    r.emitted([5])
    assert r.check_tree([5, 6, 7]) and not r.check_tree([6, 5]) and not r.check_tree([])
    out, fed, done = r.settle([5, 6, 7, 8], accepted=[0, 1, 3], bonus=9)  # path 5 -> 6 -> 8, then 9
    assert (out, fed, done) == ([6, 8, 9], [5, 6, 8], False)
    assert r.committed == [1, 2, 5, 6, 8] and r.root == 9
    assert (r.stats.rounds, r.stats.drafted, r.stats.accepted) == (1, 3, 2)


def test_a_stop_token_or_the_length_cuts_the_round_and_commits_less():
    r = Rounds([1], GenerationParams(max_new_tokens=10, stop_token_ids=(7,)))
    r.emitted(r.start(5)[0])
    assert r.settle([5, 6, 7, 8], [0, 1, 2, 3], bonus=9) == ([6, 7], [5, 6], True)
    assert r.committed == [1, 5, 6] and r.root == 7

    r = Rounds([1], GenerationParams(max_new_tokens=3))
    r.emitted(r.start(5)[0])
    assert r.settle([5, 6, 7, 8], [0, 1, 2, 3], bonus=9) == ([6, 7], [5, 6], True)  # room for 2 more
    assert Rounds([1], GenerationParams(max_new_tokens=1)).start(4) == ([4], True)


class _Prefills:
    """A verifier whose prefill answers with the stop token and a top-k row per row it was asked for."""

    length = 0

    def prefill(self, tokens, topk_rows=None):
        self.asked = topk_rows
        rows = len(tokens) if topk_rows is None else min(topk_rows, len(tokens))
        return SimpleNamespace(next_token=99, topk=[[t + 100] for t in tokens[len(tokens) - rows :]])


class _Extends:
    def extend(self, tokens, topk_rows=None):
        self.got = (list(tokens), topk_rows)


@pytest.mark.parametrize(
    "mode, prompt_topk, asked, rows",
    [
        ("racer", None, None, [[101], [102], [103]]),
        ("racer", 2, 2, [[102], [103]]),
        ("off", None, 0, []),
        ("off", 2, 0, []),
    ],
)
def test_the_drafter_gets_the_prompts_last_rows_and_an_off_turn_asks_for_none(mode, prompt_topk, asked, rows):
    v, d = _Prefills(), _Extends()
    params = GenerationParams(max_new_tokens=4, stop_token_ids=(99,), mode=mode)
    assert list(generate(d, v, [1, 2, 3], params, prompt_topk=prompt_topk)) == [[99]]  # the stop token, then done
    assert v.asked == asked and d.got == ([1, 2, 3], rows)


class _Counting:
    """A verifier whose target continues every token t with t + 1, over a cache it keeps."""

    def __init__(self):
        self.length, self.trees = 0, []

    def prefill(self, tokens, topk_rows=None):
        self.length += len(tokens)
        return SimpleNamespace(next_token=tokens[-1] + 1, topk=[[t + 1] for t in tokens[-1:]])

    def verify(self, tokens, parents):
        self.trees.append(list(tokens))
        path = [0]
        while True:
            kids = [i for i, p in enumerate(parents) if p == path[-1] and tokens[i] == tokens[path[-1]] + 1]
            if not kids:
                break
            path.append(kids[0])
        self.length += len(path)
        return SimpleNamespace(accepted=path, bonus=tokens[path[-1]] + 1, topk=[[t + 1] for t in tokens])

    def truncate(self, length):
        self.length = length


class _Resting:
    """A drafter that drafts a right two-node chain, then rests ``rests[i]`` rounds after draft i."""

    def __init__(self, rests):
        self.rests, self.rest, self.drafts, self.caught, self.seen = list(rests), 0, [], [], []

    def extend(self, tokens, topk_rows=None):
        self.seen.extend(tokens)

    def observe_tree(self, tree_tokens, tree_topk, accepted):
        pass

    def catch_up(self, tokens, topk_rows, mode):
        self.caught.append((list(tokens), [list(r) for r in topk_rows]))
        self.seen.extend(tokens)

    def draft(self, root, budget, mode):
        self.drafts.append(root)
        self.rest = self.rests.pop(0) if self.rests else 0
        return SimpleNamespace(tokens=(root, root + 1), parents=(-1, 0))


def test_a_rest_verifies_its_rounds_without_the_drafter_and_hands_it_their_tokens_at_once():
    v, d = _Counting(), _Resting([2, 0, 3])
    params = GenerationParams(max_new_tokens=14, budget=0)
    out = [t for chunk in generate(d, v, [1, 2, 3], params) for t in chunk]
    assert out == list(range(4, 18))  # what the target says, whatever the rounds
    # draft at 4 (4, 5 and the bonus 6), rest 2 rounds (6, 7), draft at 8 (8, 9, 10), draft at 10,
    # rest 3 rounds (12, 13, 14), draft at 15 (15, 16, 17: the length cuts it)
    assert d.drafts == [4, 8, 10, 15]
    assert [t for t in v.trees if len(t) == 1] == [[6], [7], [12], [13], [14]]
    assert d.caught == [([6, 7], [[7], [8]]), ([12, 13, 14], [[13], [14], [15]])]
    assert d.seen == [1, 2, 3, *range(4, 17)]  # the drafter's context: prompt and every committed token
    fixed = _Resting([2, 0, 3])  # a fixed budget never rests
    list(generate(fixed, _Counting(), [1, 2, 3], GenerationParams(max_new_tokens=14, budget=4)))
    assert fixed.drafts == [4, 6, 8, 10, 12, 14, 16]
