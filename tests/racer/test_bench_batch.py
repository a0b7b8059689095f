"""``racer bench-batch``'s table: the ratio to one session's speed, how full the verifier's forwards were,
and rows where sessions failed."""

from __future__ import annotations

from types import SimpleNamespace

from racer.bench.services import BatchRow, _batch_table

ARGS = SimpleNamespace(mode="racer", budget=0, max_new_tokens=64)


def test_the_table_gives_eight_sessions_speed_against_one_sessions():
    rows = [
        BatchRow(1, "batched", 150.0, [0.4], 1, 1, 0),
        BatchRow(1, "unbatched", 140.0, [0.5], 1, 1, 0),
        BatchRow(8, "batched", 300.0, [1.7] * 8, 8, 8, 0, forwards=70, rounds=470),
        BatchRow(8, "unbatched", 150.0, [2.8] * 8, 8, 8, 0),
    ]
    text = _batch_table(rows, ARGS)
    assert "8 sessions batched: 2.00x one session's tok/s" in text
    assert "| 8 | batched | 300.0 | 1.7 | 1.7 | 8/8 | 0 | 70 | 6.7 |" in text  # how full its forwards were
    assert "| 8 | unbatched | 150.0 | 2.8 | 2.8 | 8/8 | 0 | - | - |" in text  # not read
    assert "failed" not in text


def test_a_run_whose_one_session_failed_prints_its_table_without_a_ratio():
    rows = [
        BatchRow(1, "batched", 0.0, [], 0, 0, 1),  # its only session failed: no speed to compare with
        BatchRow(8, "batched", 300.0, [1.7] * 8, 8, 8, 0),
    ]
    text = _batch_table(rows, ARGS)
    assert "| 8 | batched | 300.0 |" in text
    assert "x one session's tok/s" not in text
    assert "some sessions failed" in text
