"""gateway/stops.py: searched piece by piece, stop strings are found where a search of the whole text
finds them, and the text OpenAI returns is cut as a one-shot search would cut it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.stops import StopStrings, StopText

ALPHABET = "ab c"
PIECES = st.lists(st.text(ALPHABET, max_size=5), max_size=8)
STOPS = st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(pieces=PIECES, stops=STOPS)
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


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(deltas=PIECES, stops=STOPS)
def test_stop_text_cuts_before_the_first_stop_string(deltas, stops):
    """Fed delta by delta (a turn ends at the delta that completes a stop string), the text handed
    out is the text so far, cut before the first stop string in it; nothing past it ever leaves."""
    text = StopText(tuple(stops))
    out, seen = "", ""
    for d in deltas:
        seen += d
        got = text.push(d)
        out += got
        assert seen.startswith(out)
        found = [i for i in (seen.find(s) for s in stops) if i >= 0]
        if found:
            assert text.hit and out == seen[: min(found)]
            return
        assert not text.hit
        held = seen[len(out) :]  # only what may still become a stop string waits
        assert held == "" or any(s.startswith(held) for s in stops)
    out += text.flush()
    assert out == seen
