"""The checked-in stubs (common/v1) match the protos."""

from __future__ import annotations

from racer import protos


def test_checked_in_stubs_are_fresh():
    assert protos.proto_files(), "no .proto files found"
    assert protos.stale() == [], "run: python -m racer.protos"
