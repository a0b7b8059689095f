"""``racer client``'s stats line: what a turn's speculation did, enough to tell a rested turn from one
whose trees were all rejected."""

from __future__ import annotations

from common.v1 import generation_pb2 as pb
from racer.client import format_stats


def test_the_stats_line_says_how_many_draft_tokens_went_out_and_how_many_were_accepted():
    last = pb.GenerateResponse(
        session_id="s1",
        finish_reason="length",
        usage=pb.Usage(completion_tokens=12),
        stats=pb.SpeculationStats(rounds=8, drafted=9, accepted=4, mat=1.5, tokens_per_second=100.0),
    )
    line = format_stats(last)
    assert line.startswith("[length] tokens=12 rounds=8 MAT=1.50 drafted=9 accepted=4 ")
    assert line.endswith("session=s1")
