"""gateway/stops.py: searched piece by piece, stop strings are found where a search of the whole text finds them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.stops import StopStrings

ALPHABET = "ab c"


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    pieces=st.lists(st.text(ALPHABET, max_size=5), max_size=8),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
)
def test_a_stop_string_is_found_at_the_piece_that_completes_it(pieces, stops):
    """As a turn pushes text token by token: the first push whose search finds a stop string is the
    first one after which the whole text holds one, and the place is the earliest one."""
    scan = StopStrings(tuple(stops))
    assert bool(scan) == bool(stops)
    text = ""
    for p in pieces:
        before, text = len(text), text + p
        whole = [i for i in (text.find(s) for s in stops) if i >= 0]
        assert scan.find(text, before) == min(whole, default=-1)
        if whole:
            return
        held = scan.held(text)  # the longest end that may still become a stop string
        assert all(not s.startswith(text[len(text) - n :]) for s in stops for n in range(held + 1, len(text) + 1))
        assert held == 0 or any(s.startswith(text[-held:]) and s != text[-held:] for s in stops)
