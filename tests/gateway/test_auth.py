"""API keys: digests only in memory, and a reload that never takes a half-written file."""

from __future__ import annotations

import asyncio
import os

import pytest

from gateway.auth import ApiKeys


def _write(path, text: str) -> None:
    path.write_text(text)
    st = os.stat(path)  # a new mtime even within one timestamp tick: the change is seen
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_a_reload_keeps_the_keys_when_the_file_looks_half_written(tmp_path):
    path = tmp_path / "keys"
    _write(path, "key-a acme-eu\nkey-b globex\n")
    keys = ApiKeys(str(path))
    assert keys.tenant("key-a") == "acme-eu" and keys.tenant("key-b") == "globex"
    # truncated mid-line: "key-a acme" would move key-a to another tenant
    _write(path, "key-a acme")
    assert not keys.maybe_reload()
    assert keys.tenant("key-a") == "acme-eu"
    _write(path, "")  # emptied by a shell redirect before it is written
    assert not keys.maybe_reload()
    assert keys.tenant("key-b") == "globex"
    _write(path, "key-a acme\n")  # whole: taken
    assert keys.maybe_reload()
    assert keys.tenant("key-a") == "acme" and keys.tenant("key-b") is None
    _write(path, "# nobody\n")  # a file that says so lets nobody in
    assert keys.maybe_reload()
    assert keys.tenant("key-a") is None


def test_watch_takes_a_changed_file_until_cancelled(tmp_path):
    path = tmp_path / "keys"
    _write(path, "key-a acme\n")
    keys = ApiKeys(str(path))

    async def run() -> None:
        reloaded = asyncio.Event()
        check = keys.maybe_reload

        def spy() -> bool:
            changed = check()
            if changed:
                reloaded.set()
            return changed

        keys.maybe_reload = spy
        watching = asyncio.create_task(keys.watch(0))
        _write(path, "key-b globex\n")  # a rotated Secret
        await reloaded.wait()
        watching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watching

    asyncio.run(run())
    assert keys.tenant("key-b") == "globex" and keys.tenant("key-a") is None
