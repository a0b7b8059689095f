"""The adaptive budget: prefixes of the big tree are the smaller trees, and the choice follows
acceptance and cost."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.costs import ContextSlope, slope_from
from drafter.adaptive import GUESSED, RETRIEVED, BudgetChooser, round_kind
from drafter.draft_session import AUTO, DrafterConfig, DraftSession


def _paths(tree) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(tree.tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out.add(tuple(reversed(path)))
    return out


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000), vocab=st.integers(3, 30), mode=st.sampled_from(["racer", "retrieval", "logits", "pld"])
)
def test_the_tree_of_budget_c_is_the_prefix_of_the_big_tree(seed, vocab, mode):
    rng = random.Random(seed)
    s = DraftSession(DrafterConfig(window=5, max_nodes=200, topk=4))
    toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 300))]
    s.extend(toks, [[rng.randrange(vocab) for _ in range(4)] for _ in toks])
    for root in range(vocab):
        full = s.draft(root, 64, mode)
        for c in (1, 2, 3, 4, 6, 8, 16, 32):
            small = full.prefix(c)
            assert _paths(small) == _paths(s.draft(root, c, mode))
            assert len(small.tokens) <= c and small.parents[0] == -1
            assert all(p < i for i, p in enumerate(small.parents) if i)


def _rounds(chooser: BudgetChooser, accepted: list[float], n: int) -> None:
    """``n`` evaluated rounds that each had ``accepted`` tokens accepted by size."""
    for _ in range(n):
        chooser.record(accepted, GUESSED)


def _session_with(costs):
    s = DraftSession(DrafterConfig(window=12, max_nodes=1000, topk=2))
    s.set_costs(costs, overhead_ms=0.0)
    return s


def test_a_repetitive_stream_with_cheap_trees_chooses_a_big_budget():
    s = _session_with({1: 10.0, 2: 10.5, 4: 11.0, 8: 11.5, 16: 12.0})
    text = [1, 2, 3, 4, 5, 6, 7] * 60
    s.extend(text[:14])
    pos = 14
    for _ in range(20):
        tree = s.draft(text[pos], AUTO, "racer")
        # accept whatever matches the true continuation, as the verifier would
        s.extend([text[pos]])
        pos += 1
        node, j = 0, pos
        while True:
            kids = [i for i, p in enumerate(tree.parents) if p == node and tree.tokens[i] == text[j]]
            if not kids:
                break
            node = kids[0]
            s.extend([text[j]])
            j += 1
        pos = j
    assert s.chooser.last_choice == 16
    assert len(s.chooser.history) >= 10
    assert s.chooser.expected_accepted()[-1] > 7


def test_unpredictable_text_with_steep_costs_turns_speculation_off():
    rng = random.Random(1)
    s = _session_with({1: 10.0, 2: 16.0, 4: 25.0, 8: 40.0})
    s.extend([rng.randrange(1000) for _ in range(20)])
    for _ in range(40):
        root = rng.randrange(1000)
        s.draft(root, AUTO, "racer")
        s.extend([root, rng.randrange(1000)])
    assert s.chooser.choose() == 1
    assert s.draft(5, AUTO, "racer").tokens == (5,)


def test_pending_trees_wait_for_the_tokens_that_decide_them():
    c = BudgetChooser({1: 1.0, 4: 1.0})
    from drafter.tree import DraftTree

    tree = DraftTree((7, 8, 9, 5), (-1, 0, 1, 0), 0, (0, 1, 2, 3))  # 7 -> 8 -> 9, 7 -> 5
    c.drafted(3, tree)
    c.observe([0, 0, 0])  # the root is not even committed
    c.observe([0, 0, 0, 7, 8])  # on the path, its end not reached
    assert not c.history
    c.observe([0, 0, 0, 7, 8, 9])
    assert list(c.history) == [[0, 2]]  # budget 1 accepts nothing, budget 4 the chain 8, 9


def test_bad_cost_curves_are_refused():
    for bad in ({}, {0: 1.0}, {1: 0.0}, {1: float("nan")}):
        with pytest.raises(ValueError):
            BudgetChooser(bad)
    with pytest.raises(ValueError, match="cost curve"):
        DraftSession().draft(1, AUTO, "racer")


def test_other_sessions_rows_make_speculation_cost_its_marginal_forward_time():
    # sub-linear alone (a big tree is cheap next to the first row), linear once many rows share it
    costs = {1: 40.0, 2: 45.0, 4: 55.0, 8: 75.0, 16: 115.0, 32: 195.0, 64: 355.0}
    c = BudgetChooser(costs, overhead_ms=0.0, prior_rounds=0.0)
    for _ in range(8):  # half a token accepted per node up to 4 nodes, nothing deeper
        c.record([0, 0.5, 1.5, 1.5, 1.5, 1.5, 1.5], GUESSED)
    assert c.choose(0) == 4  # alone: 2.5 tokens for 55 ms beats 1 for 40
    assert c.choose(60) == 1  # 60 other rows: each extra row costs 5 ms, speculation does not pay
    assert c.forward_ms(100) == pytest.approx(355.0 + 5.0 * 36)
    jagged = BudgetChooser({1: 10.0, 2: 30.0, 4: 20.0})  # the envelope never goes down
    assert jagged.forward_ms(3) == pytest.approx(30.0) and jagged.forward_ms(4) == pytest.approx(30.0)


def test_a_priced_plain_round_lets_the_budget_rest_1_2_4_up_to_32_rounds_while_no_tree_pays():
    costs = {1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}
    c = BudgetChooser(costs, overhead_ms=2.0, prior_rounds=0.0, plain_overhead_ms=0.5)
    for _ in range(8):  # a fifth of a token per tree, whatever its size
        c.record([0, 0.2, 0.2, 0.2], GUESSED)
    # the best tree: 1.2 tokens for 13 ms (size 2), against 1 token for 10.5 ms without the drafter
    rests = []
    for _ in range(8):
        assert c.choose() == 1
        rests.append(c.rest)
    assert rests == [1, 2, 4, 8, 16, 32, 32, 32]
    _rounds(c, [0, 0.9, 1.5, 2.0], 32)  # trees pay again: the next choice drafts
    assert c.choose() == 4 and c.rest == 0
    _rounds(c, [0, 0.0, 0.0, 0.0], 32)
    assert c.choose() == 1 and c.rest == 1  # a new rest starts short
    # without the price of a plain round, every round is drafted (a one-node tree at worst)
    unpriced = BudgetChooser(costs, overhead_ms=2.0, prior_rounds=0.0)
    _rounds(unpriced, [0, 0.0, 0.0, 0.0], 8)
    assert unpriced.choose() == 1 and unpriced.rest == 0
    with pytest.raises(ValueError, match="plain_overhead_ms"):
        BudgetChooser(costs, plain_overhead_ms=float("inf"))


def test_a_rest_counts_the_marginal_cost_of_a_row_among_other_sessions():
    # alone a tree pays; among 60 other rows every extra row costs 5 ms, and the budget rests
    costs = {1: 40.0, 2: 45.0, 4: 55.0, 8: 75.0, 16: 115.0, 32: 195.0, 64: 355.0}
    c = BudgetChooser(costs, overhead_ms=1.0, prior_rounds=0.0, plain_overhead_ms=0.5)
    _rounds(c, [0, 0.5, 1.5, 1.5, 1.5, 1.5, 1.5], 8)
    assert c.choose(0) == 4 and c.rest == 0
    assert c.choose(60) == 1 and c.rest == 1


def _text_session(plain_overhead_ms):
    s = DraftSession(DrafterConfig(window=12, max_nodes=1000, topk=2))
    s.set_costs({1: 10.0, 2: 12.0, 4: 15.0, 8: 20.0}, overhead_ms=2.0, plain_overhead_ms=plain_overhead_ms)
    return s


def test_catch_up_commits_what_extend_would_and_probes_only_the_budget():
    rng = random.Random(3)
    text = [rng.randrange(50) for _ in range(40)] * 3
    rows = [[rng.randrange(50), rng.randrange(50)] for _ in text]
    plain, probed = _text_session(0.5), _text_session(0.5)
    for s in (plain, probed):
        s.extend(text[:60], rows[:60])
    plain.extend(text[60:], rows[60:])
    probed.catch_up(text[60:], rows[60:])
    assert probed.history == plain.history and probed.last_topk == plain.last_topk
    for root in range(50):
        assert probed.draft(root, 8, "racer").tokens == plain.draft(root, 8, "racer").tokens
    # four probes, evenly spread, judged by the tokens after them; nothing counted as drafted
    assert len(probed.chooser.history) == 4 and not plain.chooser.history
    assert probed.drafted == plain.drafted
    with pytest.raises(ValueError, match="topk_rows"):
        probed.catch_up([1, 2], [[1, 1]])


def test_a_rest_ends_when_the_text_turns_predictable():
    """Unpredictable text makes the budget rest; the tokens of the rest, caught up with probes,
    show the text repeating, and the next step drafts a tree again."""
    rng = random.Random(4)
    s = _text_session(0.5)
    noise = [rng.randrange(10_000) for _ in range(200)]
    s.extend(noise[:20], [[t, t] for t in noise[:20]])
    pos = 20
    while s.chooser.rest == 0:  # drafted rounds on noise: nothing is accepted
        s.draft(noise[pos], AUTO, "racer")
        s.extend([noise[pos]], [[noise[pos + 1], 0]])
        pos += 1
        assert pos < 100, "the budget never rested"
    phrase = [rng.randrange(10_000) for _ in range(12)]
    tail = phrase * 8
    at = 0
    for _ in range(40):  # each rest's tokens come back with the next step, which drafts again
        n = s.chooser.rest
        s.catch_up(tail[at : at + n], [[t, t] for t in tail[at + 1 : at + n + 1]])
        at += n
        tree = s.draft(tail[at], AUTO, "racer")
        if s.chooser.rest == 0:
            break
        s.extend([tail[at]], [[tail[at + 1], 0]])
        at += 1
    assert s.chooser.rest == 0 and len(tree.tokens) > 1


def test_a_long_session_prices_its_trees_at_its_own_length():
    # the curve at 256 tokens: a 4-node tree 1.2x a step; each token beyond adds 2 us a row
    costs = {1: 5.0, 2: 5.5, 4: 6.0, 8: 8.0}
    slope = ContextSlope(256, {1: 0.002, 2: 0.004, 4: 0.008, 8: 0.016})
    c = BudgetChooser(costs, overhead_ms=0.5, prior_rounds=0.0, plain_overhead_ms=0.0, slope=slope)
    _rounds(c, [0, 0.3, 0.45, 0.5], 8)  # what a chat turn's trees get accepted
    assert c.choose(0, 256) == 4  # 1.45 tokens for 6.5 ms beats 1 for 5 ms
    assert c.choose(0, 100) == 4 and c.rest == 0  # shorter: cheaper still
    # 2,000 tokens later the 4-node tree costs 22 ms against a step's 9: no tree pays, the budget rests
    assert c.choose(0, 2256) == 1 and c.rest == 1
    assert c.choose(0) == 4  # a length not given: the curve as measured
    flat = BudgetChooser(costs, overhead_ms=0.5, prior_rounds=0.0, plain_overhead_ms=0.0)
    _rounds(flat, [0, 0.3, 0.45, 0.5], 8)
    assert flat.choose(0, 2256) == 4  # without the slope the length changes nothing


def test_a_context_slope_interpolates_between_sizes_and_refuses_bad_values():
    s = ContextSlope(256, {1: 0.002, 4: 0.008, 16: 0.02})
    assert s.ms(1, 1256) == pytest.approx(2.0)
    assert s.ms(2, 1256) == pytest.approx(4.0)  # linear between 1 and 4
    assert s.ms(32, 1256) == pytest.approx(40.0)  # past the last size: in proportion to the rows
    assert s.ms(4, 128) == pytest.approx(-1.024)  # shorter than measured: cheaper
    measured = slope_from({1: 5.0, 4: 7.0}, {1: 7.0, 4: 6.5}, 256, 1256)
    assert measured.per_token == {1: pytest.approx(0.002), 4: 0.0}  # a size that only drifted adds nothing
    for bad in ({}, {0: 0.1}, {1: -0.1}, {1: float("inf")}):
        with pytest.raises(ValueError):
            ContextSlope(256, bad)
    with pytest.raises(ValueError):
        ContextSlope(-1, {1: 0.1})
    with pytest.raises(ValueError):
        slope_from({1: 5.0}, {1: 6.0}, 256, 256)


def test_each_kind_of_round_chooses_from_its_own_statistics():
    """A round whose tree holds a retrieved continuation gets its trees accepted far more often than
    one with the copy-logit guess alone; pooled, the guesses' rounds would drag the retrieved ones'
    choice down (and lift their own). Where the retrieved rounds are frequent enough to pay for
    asking, a guessed round verifies one node and the drafter is asked again the next round."""
    costs = {1: 10.0, 2: 11.5, 4: 14.0, 8: 20.0}
    c = BudgetChooser(costs, overhead_ms=0.5, prior_rounds=0.0, plain_overhead_ms=0.0)
    for _ in range(8):
        c.record([0, 0.8, 2.0, 3.0], RETRIEVED)  # 3 tokens for 14.5 ms, where a step gives 1 for 10
        for _ in range(3):
            c.record([0, 0.1, 0.15, 0.15], GUESSED)
    assert c.choose(kind=RETRIEVED) == 4 and c.rest == 0
    assert c.choose(kind=GUESSED) == 1 and c.rest == 0  # a quarter of the rounds save 15.5 ms each
    # pooled, a 4-node tree: 1.6 tokens for 14.5 ms, against 1 for 10: every round gets it
    assert c.choose() == 4
    # where the retrieved rounds are rare, asking for them does not pay for the drafter's hop
    rare = BudgetChooser(costs, overhead_ms=0.5, prior_rounds=0.0, plain_overhead_ms=0.0)
    rare.record([0, 0.8, 2.0, 3.0], RETRIEVED)
    for _ in range(31):
        rare.record([0, 0.1, 0.15, 0.15], GUESSED)
    assert rare.choose(kind=RETRIEVED) == 4
    assert rare.choose(kind=GUESSED) == 1 and rare.rest == 1


def test_a_trees_kind_is_whether_it_holds_a_retrieved_continuation():
    s = DraftSession(DrafterConfig(window=8, max_nodes=1000, topk=2))
    text = [1, 2, 3, 4, 5, 6]
    s.extend(text * 3, [[t % 6 + 1, 9] for t in text * 3])
    assert round_kind(s.draft(1, 8, "racer")) == RETRIEVED  # "..., 6, 1" went on with "2, 3, 4"
    assert round_kind(s.draft(7, 8, "racer")) == GUESSED  # 7 never came: its row's guesses only


def test_the_drafted_tree_stops_at_the_largest_size_that_could_pay():
    costs = {1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0, 16: 30.0, 32: 60.0, 64: 120.0}
    c = BudgetChooser(costs, overhead_ms=0.0, prior_rounds=0.0)
    assert c.largest == 64  # nothing known yet
    c.record([0, 0, 1, 1, 1, 1, 1], GUESSED)  # at most one token accepted: 4 tokens pay up to 30 ms
    assert c.largest == 16
    c.record([0, 1, 2, 3, 5, 8, 8], RETRIEVED)  # a run of 8: 11 tokens pay up to 110 ms
    assert c.largest == 32
    flat = BudgetChooser({1: 10.0, 64: 11.0}, overhead_ms=0.0)
    flat.record([0, 0], GUESSED)
    assert flat.largest == 64  # on a flat curve every size could pay


def test_the_windows_sums_follow_the_rounds_that_leave_them():
    rng = random.Random(5)
    c = BudgetChooser({1: 1.0, 2: 1.5, 4: 2.0}, window=8, prior_rounds=1.0)
    rounds = []
    for _ in range(100):
        row, kind = [0, rng.randrange(2), rng.randrange(4)], rng.choice((GUESSED, RETRIEVED))
        c.record(row, kind)
        rounds.append((row, kind))
    last = [r for r, _ in rounds[-8:]]
    pooled = [(sum(r[j] for r in last) + 0.5 * math.log2(n)) / 9 for j, n in enumerate((1, 2, 4))]
    assert c.expected_accepted() == pytest.approx(pooled)
    for kind in (GUESSED, RETRIEVED):
        own = [r for r, k in rounds if k == kind][-8:]
        want = [(sum(r[j] for r in own) + p) / (len(own) + 1) for j, p in enumerate(pooled)]
        assert c.expected_accepted(kind) == pytest.approx(want)
    with pytest.raises(ValueError, match="accepted"):
        c.record([0, 1], GUESSED)
