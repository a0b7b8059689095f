"""Where the verifier keeps what it makes once per machine: the converted default model, the native
kernels built for this CPU, measured kernel plans and the copy-logit prior (``RACER_CACHE``, else
``$XDG_CACHE_HOME/racer``, else ``~/.cache/racer``). Below every other verifier module."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("RACER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "racer"
    )
    return Path(base)
