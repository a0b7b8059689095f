"""In one process the budget's cost curve follows what the forwards take, as a verifier service's
does: each stream's rounds move the curve the next stream's drafter is given."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from common.costs import FOLLOW, ContextSlope, follow
from common.loop import Stats
from racer.inprocess import InProcessStack
from tests.support.families import echo_prompt
from tests.support.models import make_tiny_llama
from verifier.model import LoadedModel


def test_each_streams_forwards_move_the_curve_the_next_drafter_gets(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    model = make_tiny_llama()
    engine = InProcessStack(
        LoadedModel(model, SimpleNamespace(pad_token_id=0, eos_token_id=2), Path(tmp_path)), prior=None
    )
    engine.costs = {1: 1000.0, 64: 5000.0}  # far from what a tiny model's forward takes
    stats = Stats()
    out = [
        t
        for chunk in engine.stream(
            echo_prompt(model), engine.default_params(max_new_tokens=12, mode="off"), stats=stats
        )
        for t in chunk
    ]
    assert out and stats.forwards and all(n == 1 for n, _, _ in stats.forwards)
    want = {1: 1000.0, 64: 5000.0}
    for _, _, ms in stats.forwards:  # no slope measured: each forward as it took
        want[1] = max(0.1 * want[1], want[1] + FOLLOW * (ms - want[1]))
    assert engine.costs == pytest.approx(want)
    assert engine.costs[1] < 1000.0 * (1 - FOLLOW) ** (len(stats.forwards) - 1)
    assert engine.costs[64] == 5000.0  # no forward of that size: as measured
    assert engine.new_drafter().chooser.cost == engine.costs


def test_a_forward_is_taken_back_to_the_curves_context_before_it_counts():
    slope = ContextSlope(256, {1: 0.01})
    curve = {1: 5.0}
    follow(curve, slope, 1, 1256, 15.0)  # 10 ms of it are the 1,000 tokens beyond the curve's 256
    assert curve[1] == pytest.approx(5.0)
    follow(curve, None, 1, 1256, 15.0)  # without a slope the average follows the length too
    assert curve[1] == pytest.approx(5.0 + FOLLOW * 10.0)
    follow(curve, None, 2, 256, 1.0)  # a size the curve does not hold
    assert curve == {1: pytest.approx(5.5)}
