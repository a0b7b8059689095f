"""Logging the servers share: warnings that a failure storm cannot flood (at most one every ``every``
seconds, each saying how many were not logged since the last; a metric counts them all), and a bug
logged under an id that the caller's error carries."""

from __future__ import annotations

import logging
import secrets
import time


def log_bug(log: logging.Logger, where: str, **extra) -> str:
    """Logs the exception being handled, with its traceback, under a short id; returns the caller's
    message, which says the id and nothing of the exception (no internal details leave the process).
    ``where``: what was handling it ("an RPC handler"); ``extra``: fields of the log line."""
    eid = secrets.token_hex(4)
    log.error(f"unhandled exception in {where}", exc_info=True, extra={**extra, "error_id": eid})
    return f"internal error (id {eid}); see the server log"


class Throttled:
    def __init__(self, log: logging.Logger, every: float = 10.0):
        self.log = log
        self.every = every
        self._at = -1e9  # monotonic seconds of the last warning
        self._unlogged = 0

    def warning(self, msg: str, **extra) -> None:
        now = time.monotonic()
        if now - self._at >= self.every:
            self.log.warning(msg, extra={**extra, "not_logged": self._unlogged})
            self._at, self._unlogged = now, 0
        else:
            self._unlogged += 1
