"""The round's bookkeeping keeps committed = prompt + emitted, minus the last, however a round ends."""

from __future__ import annotations

from common.loop import Rounds
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
