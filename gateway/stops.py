"""Stop strings in a growing text: where the turn ends (``turn``), and the text OpenAI returns (``openai_http``).

Text arrives a token at a time, so a stop string may straddle two pushes: each search starts the
longest stop string's length before the new text, and a text that ends with the start of a stop
string may still become one.
"""

from __future__ import annotations


class StopStrings:
    """A request's stop strings, searched in a text that only grows."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, since: int = 0) -> int:
        """Where the first stop string in ``text`` starts, or -1; ``text[:since]`` was searched before
        (only a stop string that reaches past it can be new)."""
        start = max(0, since - self.longest)
        return min((i for i in (text.find(s, start) for s in self.stops) if i >= 0), default=-1)

    def held(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins a stop string (it may become one)."""
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                return n
        return 0


class StopText:
    """The text OpenAI returns: up to, not including, the first stop string. While streaming, text
    that may be the start of a stop string is held back until the next tokens tell."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = StopStrings(stops)
        self.text = ""
        self.sent = 0  # characters of ``text`` handed out
        self.hit = False  # a stop string ended the text

    def push(self, delta: str) -> str:
        if self.hit:
            return ""
        self.text += delta
        cut = self.stops.find(self.text, self.sent)
        self.hit = cut >= 0
        end = cut if self.hit else len(self.text) - self.stops.held(self.text)
        out = self.text[self.sent : max(self.sent, end)]
        self.sent = max(self.sent, end)
        return out

    def flush(self) -> str:
        """What was held back, at the end of a turn that no stop string ended."""
        if self.hit:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
