"""gateway/records.py: a stored record is read back only if it is exactly a record of its key, and
records written before the record became a pydantic model still load, byte for byte."""

from __future__ import annotations

import json

import pytest

from gateway.records import Record, RecordError

# As the gateway wrote records before (json.dumps of the dataclass's fields, compact separators).
OLD = (
    b'{"session_id":"s1","tenant":"acme","history":[1,2,3,48000],"turns":2,'
    b'"verifier":"10.0.0.7:50052","created":1796047070.8069403,"last_used":1796047132.25}'
)


def test_a_record_written_the_old_way_loads_and_is_written_back_the_same():
    rec = Record.loads(OLD, "acme", "s1", vocab_size=49152)
    assert (rec.session_id, rec.tenant, rec.history, rec.turns) == ("s1", "acme", [1, 2, 3, 48000], 2)
    assert (rec.verifier, rec.created, rec.last_used) == ("10.0.0.7:50052", 1796047070.8069403, 1796047132.25)
    assert rec.stored == OLD and rec.dumps() == OLD
    old_way = json.dumps(json.loads(OLD), separators=(",", ":")).encode()  # the old dumps, for a record made here
    new = Record.new("s2", "acme")
    new.history, new.turns = [7, 8], 1
    assert new.dumps() == json.dumps({**json.loads(old_way), **json.loads(new.dumps())}, separators=(",", ":")).encode()
    assert Record.loads(new.dumps(), "acme", "s2").dumps() == new.dumps() and new.stored is None
    whole = Record.loads(OLD.replace(b"1796047070.8069403", b"1796047070"))  # a whole number of seconds
    assert whole.created == 1796047070.0


BAD = {
    "history": lambda d: {**d, "history": [str(t) for t in d["history"]]},
    "history.1": lambda d: {**d, "history": [1, -2]},
    "turns": lambda d: {**d, "turns": True},
    "created": lambda d: {**d, "created": float("nan")},
    "last_used": lambda d: {**d, "last_used": "now"},
    "admin": lambda d: {**d, "admin": True},
    "verifier": lambda d: {k: v for k, v in d.items() if k != "verifier"},
    "tenant": lambda d: {**d, "tenant": "globex"},
    "session_id": lambda d: {**d, "session_id": "someone-else"},
    "history: token": lambda d: {**d, "history": [49152]},
    "record": lambda d: [d],
}


@pytest.mark.parametrize("field", list(BAD))
def test_a_bad_record_is_refused_naming_the_field(field):
    data = json.dumps(BAD[field](json.loads(OLD))).encode()
    with pytest.raises(RecordError) as e:
        Record.loads(data, "acme", "s1", vocab_size=49152)
    assert str(e.value).startswith(field), str(e.value)


@pytest.mark.parametrize("data", [b"\xff{", b"[" * 100_000, b'{"session_id": "s1"', b""])
def test_bytes_that_are_not_json_are_refused(data):
    with pytest.raises(RecordError):
        Record.loads(data, "acme", "s1")
