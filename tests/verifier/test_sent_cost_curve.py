"""The cost curve a verifier sends with each open: its slope only where a drafter would take it (a
slope the drafter refused would fail the turn's open there)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from common.costs import ContextSlope
from verifier.service import _cost_curve


def test_the_curve_carries_the_slope_at_each_size():
    slope = ContextSlope(256, {1: 0.002, 16: 0.010})
    curve = _cost_curve(SimpleNamespace(cost={1: 5.0, 4: 7.0, 16: 20.0}, slope=slope))
    assert list(curve.sizes) == [1, 4, 16] and list(curve.ms) == [5.0, 7.0, 20.0]
    assert curve.context == 256 and list(curve.ms_per_token) == [slope.at(1), slope.at(4), slope.at(16)]
    ContextSlope(curve.context, dict(zip(curve.sizes, curve.ms_per_token)))  # as a drafter takes it


def test_a_slope_a_drafter_would_refuse_is_left_out_and_logged(caplog):
    broken = SimpleNamespace(context=256, at=lambda rows: float("nan"))
    with caplog.at_level(logging.ERROR, logger="racer.verifier"):
        curve = _cost_curve(SimpleNamespace(cost={1: 5.0, 4: 7.0}, slope=broken))
    assert list(curve.sizes) == [1, 4] and list(curve.ms) == [5.0, 7.0]
    assert not curve.ms_per_token  # the drafter then prices trees without the context's part
    assert "context slope not sent" in caplog.text
