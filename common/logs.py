"""Warnings that a failure storm cannot flood: at most one every ``every`` seconds, each saying how
many were not logged since the last (a metric counts them all)."""

from __future__ import annotations

import logging
import time


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
