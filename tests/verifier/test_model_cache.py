"""The conversion cache's own hygiene (``verifier.model.prune_stale``) on directories made by hand:
no model is converted here (``test_gguf_tokenizer.py`` prunes through real conversions)."""

from __future__ import annotations

import json
import os
import time

from verifier import model


def _complete(path, source=None):
    path.mkdir()
    (path / ".complete").touch()
    if source is not None:
        st = source.stat()
        record = {"path": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        (path / model._SOURCE).write_text(json.dumps(record))
    return path


def test_an_unfinished_conversion_is_removed_once_abandoned_and_kept_while_it_may_be_written(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    live = _complete(models / "m-0123456789ab-fp32", gguf)
    old = models / "m-0123456789ab-fp32.tmp4242"  # a writer killed a day ago
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"x" * 64)
    stale = time.time() - model._ABANDONED - 60
    os.utime(old, (stale, stale))
    fresh = models / "m-ba9876543210-fp32.tmp4343"  # a writer at work, maybe in another container
    fresh.mkdir()
    named_so = _complete(models / "notes.tmpfile")  # not a writer's directory: the name only looks so
    os.utime(named_so, (stale, stale))

    assert model.prune_stale(models) == [old]
    assert not old.exists()
    assert live.exists() and fresh.exists() and named_so.exists()
