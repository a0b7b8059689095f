"""The verifier's cost curve and its slope against the context: measured on the model, the longer
cache filled with the first one's rows, cut to what the model's positions hold."""

from __future__ import annotations

import pytest

from tests.support.models import make_tiny_llama
from verifier.engine import SLOPE_SIZES, VerifierSession, measure_cost_slope


def test_the_slope_is_measured_at_a_second_length_over_the_slope_sizes(tiny_llama, monkeypatch):
    seen = set()
    real = VerifierSession.verify

    def verify(self, tokens, parents):
        seen.add((self.length, len(tokens)))
        return real(self, tokens, parents)

    monkeypatch.setattr(VerifierSession, "verify", verify)
    sizes = (1, 2, 4, 8, 16)
    curve, slope = measure_cost_slope(tiny_llama, sizes=sizes, contexts=(32, 160), reps=1)
    # every size over 32 tokens of cache; the slope's sizes over 160 (the first cache's rows again)
    assert seen == {(32, n) for n in sizes} | {(160, n) for n in sizes if n in SLOPE_SIZES}
    assert sorted(curve) == list(sizes) and all(c > 0 for c in curve.values())
    assert slope is not None and slope.context == 32
    assert sorted(slope.per_token) == [n for n in sizes if n in SLOPE_SIZES]
    assert all(v >= 0 for v in slope.per_token.values())


def test_each_measured_verification_follows_a_one_token_step(tiny_llama, monkeypatch):
    """A decoding loop's round follows the round before it, most often a small one; a one-token step
    timed right after a 64-node tree took the default model 5.2 ms against 4.6 back to back."""
    calls = []
    real = VerifierSession.verify

    def verify(self, tokens, parents):
        calls.append((id(self), self.length, len(tokens)))
        return real(self, tokens, parents)

    monkeypatch.setattr(VerifierSession, "verify", verify)
    sizes = (1, 4, 64)
    measure_cost_slope(tiny_llama, sizes=sizes, contexts=(32, 160), reps=2)
    # per repetition (the first one untimed too) and size, each session: a one-token step, then the size
    assert len(calls) == 3 * (len(sizes) + len([n for n in sizes if n in SLOPE_SIZES])) * 2
    for (s1, len1, n1), (s2, len2, _) in zip(calls[::2], calls[1::2]):
        assert n1 == 1 and s1 == s2 and len1 == len2  # the step over the same cache, cut back after it
    assert [n for _, _, n in calls[1::2]][:4] == [1, 1, 4, 4]  # sizes interleaved, both lengths each


def _positions(n: int):
    model = make_tiny_llama()
    model.config.max_position_embeddings = n
    return model


def test_a_model_whose_positions_end_before_the_second_length_gets_no_slope():
    curve, slope = measure_cost_slope(_positions(48), sizes=(1, 4, 16), contexts=(32, 1280), reps=1)
    assert slope is None and sorted(curve) == [1, 4, 16]  # 1,280 cut to 48 - 16 - 1 = 31 tokens: none longer
    _, cut = measure_cost_slope(_positions(128), sizes=(1, 4, 16), contexts=(32, 1280), reps=1)
    assert cut is not None and cut.context == 32  # measured over 128 - 16 - 1 = 111 tokens


@pytest.mark.parametrize("bad", [(256, 256), (256, 128)])
def test_the_second_length_must_exceed_the_first(tiny_llama, bad):
    curve, slope = measure_cost_slope(tiny_llama, sizes=(1, 4), contexts=bad, reps=1)
    assert slope is None and sorted(curve) == [1, 4]
